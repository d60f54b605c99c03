"""A model family made on the spot, for benchmarks on machines without any checkpoint or network.

The target is a random Llama whose layers past the first ``cut`` are damped (their attention and
MLP output projections scaled by ``damp``), so its next token is mostly decided by its first
layers; the drafters are those first layers cut out of it (embeddings, the first ``n`` blocks, the
final norm and the head, the same weights), so their drafts are partly right, as a distilled
drafter's are. Written as a zoo (:mod:`cosine_zoo.manifest`): ``cosine bench`` and every engine load
it like any other.

Shapes (:data:`FAMILIES`):

- ``1b``: hidden 2048, 16 layers, 32 heads (8 KV heads), MLP 5632, vocabulary 32,000: about 1.1 B
  parameters, a Llama-1B-like verifier pass on a GPU. Weights are stored in bfloat16 (half the disk);
  a float32 engine upcasts them.
- ``smoke``: hidden 64, 4 layers, vocabulary 512: the same suite in seconds on a CPU (tests).

Two domains, ``low`` and ``high``, whose prompts draw words from the lower and the upper half of the
vocabulary (a Zipf-like law in each), so the routers' lexicon has something to tell apart. The
acceptance matrix written is a flat prior of 1.0 (``evaluation.measured: false``): the family's
figures are measured by the runs that use it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

DOMAINS = ("low", "high")
PRIOR_ACCEPTANCE = 1.0


@dataclass(frozen=True)
class FamilySpec:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    cut: int  # layers [cut, layers) are damped
    damp: float
    drafters: tuple[tuple[str, int], ...]  # (name, first layers kept)
    prompts_per_domain: int
    prompt_words: tuple[int, int]  # min, max words of a prompt
    store_dtype: str  # dtype of the stored weights

    @property
    def init_std(self) -> float:
        # transformers' tests' 0.2 at hidden 64, scaled so each block's output keeps that size at
        # any width: peaked next-token distributions, so greedy decoding has no near-ties to trip on
        return 0.2 * (64 / self.hidden) ** 0.5


FAMILIES = {
    "1b": FamilySpec(
        hidden=2048,
        layers=16,
        heads=32,
        kv_heads=8,
        intermediate=5632,
        vocab=32000,
        cut=2,
        damp=0.06,  # about 1.6 accepted tokens a round at k=4 at this depth (measured at hidden 512)
        drafters=(("generalist", 2), ("deep", 3)),
        prompts_per_domain=48,
        prompt_words=(24, 96),
        store_dtype="bfloat16",
    ),
    "smoke": FamilySpec(
        hidden=64,
        layers=4,
        heads=4,
        kv_heads=2,
        intermediate=128,
        vocab=512,
        cut=1,
        damp=0.1,
        drafters=(("generalist", 1), ("deep", 2)),
        prompts_per_domain=12,
        prompt_words=(6, 20),
        store_dtype="float32",
    ),
}


def family_config(spec: FamilySpec, layers: int | None = None) -> Any:
    from cosine_zoo.random_checkpoints import make_config

    return make_config(
        "llama",
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers if layers is None else layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=4096,
        initializer_range=spec.init_std,
    )


def family_prompts(spec: FamilySpec, seed: int) -> dict[str, list[list[int]]]:
    """Token ids of each domain's prompts: words from its half of the vocabulary, Zipf-like."""
    gen = torch.Generator().manual_seed(seed)
    half = spec.vocab // 2
    weights = 1.0 / torch.arange(1, half + 1, dtype=torch.float64)
    lo, hi = spec.prompt_words
    out: dict[str, list[list[int]]] = {}
    for d, domain in enumerate(DOMAINS):
        perm = torch.randperm(half, generator=gen) + d * half  # which words of the half are frequent
        rows = []
        for _ in range(spec.prompts_per_domain):
            n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
            rows.append(perm[torch.multinomial(weights, n, replacement=True, generator=gen)].tolist())
        out[domain] = rows
    return out


def build_family(root: str | Path, name: str = "smoke", seed: int = 0, progress: Any = None) -> Path:
    """Write the family ``name`` (:data:`FAMILIES`) as a zoo under ``root``; return ``root``.
    ``progress(message)`` hears of each model written. Rebuilds from scratch every time (seeded)."""
    from transformers import AutoModelForCausalLM

    from common.runtime.checkpoints import load_tokenizer, tokenizer_fingerprint
    from cosine_zoo.manifest import FORMAT, write_lexicon, write_manifest, write_prompts
    from cosine_zoo.random_checkpoints import make_tokenizer

    spec = FAMILIES[name]
    say = progress or (lambda _msg: None)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    store = getattr(torch, spec.store_dtype)
    tokenizer = make_tokenizer(spec.vocab)
    tokenizer.save_pretrained(str(root / "tokenizer"))

    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(family_config(spec), dtype=torch.float32)
    with torch.no_grad():
        for layer in target.model.layers[spec.cut :]:
            layer.self_attn.o_proj.weight.mul_(spec.damp)
            layer.mlp.down_proj.weight.mul_(spec.damp)
    _save(target.to(store), tokenizer, root / "target")
    say(f"target   {_params(target) / 1e6:.1f} M parameters, layers {spec.cut}-{spec.layers - 1} damped x{spec.damp}")

    entries = {}
    for drafter, keep in spec.drafters:
        model = AutoModelForCausalLM.from_config(family_config(spec, layers=keep), dtype=store)
        own = model.state_dict()
        model.load_state_dict({k: v for k, v in target.state_dict().items() if k in own}, strict=True)
        _save(model, tokenizer, root / "drafters" / drafter)
        entries[drafter] = {
            "path": f"drafters/{drafter}",
            "params": _params(model),
            "domains": list(DOMAINS),
            "layers_of_target": keep,
        }
        say(f"drafter  {drafter}: the target's first {keep} layers, {_params(model) / 1e6:.1f} M parameters")

    ids = family_prompts(spec, seed)
    texts = {d: [" ".join(f"<t{t}>" for t in row) for row in rows] for d, rows in ids.items()}
    write_prompts(root, texts)
    write_lexicon(root, ids)
    manifest = {
        "format": FORMAT,
        "profile": f"synthetic-{name}",
        "seed": seed,
        "domains": list(DOMAINS),
        "tokenizer": {"path": "tokenizer", "fingerprint": tokenizer_fingerprint(load_tokenizer(root / "tokenizer"))},
        "target": {"path": "target", "params": _params(target), "domains": list(DOMAINS)},
        "drafters": entries,
        "prompts": {"path": "prompts.jsonl", "per_domain": spec.prompts_per_domain},
        "evaluation": {
            "k": 4,
            "measured": False,
            "acceptance": {d: dict.fromkeys(DOMAINS, PRIOR_ACCEPTANCE) for d in entries},
            "target_perplexity": {},
        },
        "profile_spec": asdict(spec),
    }
    write_manifest(root, manifest)
    (root / "family.json").write_text(json.dumps({"family": name, "seed": seed}) + "\n")
    return root


def _save(model: Any, tokenizer: Any, path: Path) -> None:
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))


def _params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())
