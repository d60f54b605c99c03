"""A batched forward over a Hugging Face causal LM's weights, on per-request KV caches.

Both engines use it: the drafter with causal chains of new tokens, the verifier with a chain (the
uncached committed tokens) followed by a token tree. One call runs one forward pass for a whole
batch of sequences whose caches have different lengths and whose new-token counts differ.

How it works: the new tokens of every sequence are packed into ``[N, hidden]`` activations, so
embeddings, norms, projections and MLPs run once for the batch with no padding. Only attention
sees the per-sequence structure: each layer writes the new keys/values into the caches' pending
slots, then an :class:`~common.runtime.attention.AttentionBackend` attends each new token to its
sequence's committed cache entries and to its new-token ancestors (tree mask). Position ids are
``cache length + depth`` (depth in the tree, not index in the array), fed to the model's own rotary
embedding module, so every RoPE variant transformers implements (default, llama3, linear,
dynamic, yarn, ...) is computed by the same code as in ``generate``.

The caches are either per-request (:mod:`common.runtime.kv_cache`, attended by the backend) or
blocks of one paged arena (:mod:`common.runtime.kv_arena`): a pass whose caches are
:class:`~common.runtime.kv_arena.PagedCache` s runs the same layers with
:class:`~common.runtime.paged_runner.PagedPass` for their attention, with one batched write and
one attention call a layer and its metadata built once. Which one a runner makes (``new_pool``) is
its ``kv_cache`` (``--kv-cache``).

The runner reuses the checkpoint's modules (embedding, RMSNorm, q/k/v/o projections with or
without bias, gated MLP, final norm, lm_head, tied or not) and replaces only the attention and
cache plumbing; on a CPU in float32 a layer's q/k/v and its gate/up are each one product over
their stacked weights (:mod:`common.runtime.fused_projections`: the same outputs in fewer calls). Supported
families: Llama, Mistral and Qwen2 (GQA included). Every new token attends every cached token of
its sequence, so a sliding window is exact only when it is at least the model's context (Mistral's
``sliding_window`` None or ``>= max_position_embeddings``: the engines never let a sequence grow
past that context); anything else, a narrower window included, is refused at load with
:class:`UnsupportedArchitecture` before the weights are read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.logs import get_logger
from common.runtime.attention import AttentionBackend, BatchLayout
from common.runtime.attention_selection import pick_backend
from common.runtime.checkpoints import (
    CheckpointError,
    load_causal_lm,
    load_tokenizer,
    read_config,
    tokenizer_fingerprint,
)
from common.runtime.cpu_attention import CpuKernelBackend
from common.runtime.cpu_linear import use_cpu_linears
from common.runtime.cuda_graphs import PassGraphs
from common.runtime.draft_vocab import DraftVocab, load_draft_vocab
from common.runtime.flashinfer_paged import missing_reason as flashinfer_missing
from common.runtime.flashinfer_paged import new_wrapper as new_flashinfer_wrapper
from common.runtime.flex_paged import flex_available
from common.runtime.fused_projections import LayerProducts, stack_layers
from common.runtime.invariant_bf16 import InvariantAttention, bf16_available, use_invariant_linears
from common.runtime.kv_arena import ARENA_BACKENDS, KVArena, PagedCache, select_kv_cache
from common.runtime.kv_cache import KVCache, KVPool
from common.runtime.paged_runner import PagedPass
from common.spec.types import ModelInfo

log = get_logger(__name__)

SUPPORTED_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype: str, device: str | torch.device = "cpu") -> str:
    """``auto`` is bfloat16 on a CPU whose bfloat16 products are row-invariant (AMX, see
    ``common/runtime/invariant_bf16.py``: as lossless as float32 and faster at every row count that a verify
    pass has), float32 anywhere else; any other name is returned as it is."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if torch.device(device).type == "cpu" and bf16_available() else "float32"


class UnsupportedArchitecture(CheckpointError):
    """The checkpoint is of a model family the runner does not implement."""


def check_architecture(config: dict[str, Any], path: str | Path) -> str:
    """Return the architecture name of a supported checkpoint config, or raise :class:`UnsupportedArchitecture`."""
    model_type = config.get("model_type", "")
    archs = config.get("architectures") or [SUPPORTED_MODEL_TYPES.get(model_type, model_type)]
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitecture(
            f"{path}: unsupported architecture {archs[0]!r} (model_type {model_type!r}); "
            f"supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES.values()))}"
        )
    layer_types = config.get("layer_types") or []
    if "sliding_attention" in layer_types or (config.get("use_sliding_window") and config.get("sliding_window")):
        raise UnsupportedArchitecture(f"{path}: sliding-window attention layers are not supported")
    if model_type == "mistral":
        _check_mistral_window(config, path)
    return archs[0]


def _check_mistral_window(config: dict[str, Any], path: str | Path) -> None:
    """Mistral applies ``sliding_window`` to every layer: query position ``i`` sees keys ``j`` with
    ``i - j < window``. Positions stay below ``max_position_embeddings`` (the engines' context), so a
    window of at least that is full attention, which is what the runner computes; a narrower one is
    refused. A field the config file leaves out has transformers' default for the family (a
    4096-token window), so it is read from there, not taken as absent."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model("mistral")
    window = config["sliding_window"] if "sliding_window" in config else defaults.sliding_window
    context = int(config.get("max_position_embeddings") or defaults.max_position_embeddings)
    if window is not None and int(window) < context:
        raise UnsupportedArchitecture(
            f"{path}: sliding_window {window} is narrower than the context of {context} tokens "
            "(max_position_embeddings); the runner attends every cached token, so only a window of at least "
            "the context, or none (null), is exact"
        )


@dataclass(frozen=True)
class SeqInput:
    """One sequence of a batched forward.

    ``token_ids``: the ``t >= 1`` new tokens; ``parents``: per new token, the index of its parent
    among the new tokens or -1 (hangs off the cache); ``None`` = a causal chain. ``logit_rows``:
    the new-token rows whose next-token logits are wanted (default: the last one).
    The pass writes the new tokens' keys/values into ``cache``'s pending slots; the caller then
    commits what it keeps (``cache.commit``).
    """

    cache: KVCache | PagedCache
    token_ids: tuple[int, ...]
    parents: tuple[int, ...] | None = None
    logit_rows: tuple[int, ...] | None = None


class LMRunner:
    """Batched forward of a Llama/Mistral/Qwen2 ``*ForCausalLM`` over per-request caches."""

    def __init__(
        self,
        model: Any,
        backend: AttentionBackend,
        *,
        name: str = "",
        tokenizer_fp: str = "",
        draft_vocab: DraftVocab | None = None,
        kv_cache: str = "contiguous",
    ) -> None:
        if kv_cache not in ("paged", "contiguous"):
            raise ValueError(f"kv_cache must be paged or contiguous, got {kv_cache!r}")
        cfg = model.config
        check_architecture(cfg.to_dict(), name or cfg.model_type)
        param = next(model.parameters())
        # CPU float32: q/k/v and gate/up as one product each (fused_projections.py), and every
        # projection with the kernel fast at its row count (cpu_linear.py)
        self.products = (
            stack_layers(list(model.model.layers))
            if param.device.type == "cpu" and param.dtype == torch.float32
            else None
        )
        use_cpu_linears(model if self.products is None else _pass_order(model, self.products))
        if isinstance(backend, (InvariantAttention, CpuKernelBackend)):  # CPU bfloat16: every row as if alone
            use_invariant_linears(model)
        self.model = model
        self.config = cfg
        self.backend = backend
        self.kv_cache = kv_cache  # paged: KVArena caches, PagedPass; contiguous: KVPool caches and backend
        self.name = name
        self.tokenizer_fingerprint = tokenizer_fp
        inner = model.model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = model.lm_head
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.scale = attn.scaling
        self.device, self.dtype = param.device, param.dtype
        # a reduced draft vocabulary: ids in and logits out stay in the target's id space
        self.draft_vocab = draft_vocab.to(self.device) if draft_vocab is not None else None
        # paged passes through bucketed graphs: "capture" (CUDA graphs), "static" (the same bucketed
        # pass run eagerly: how a CPU tests it) or "off"; the graphs are made at the first paged pass
        self.graph_mode = "off"
        self.graphs: PassGraphs | None = None
        # the paged arena's attention: "sdpa" (a gathered view), "flex" or "flashinfer" (in place)
        self.paged_attention = "sdpa"
        self.flashinfer_wrapper: Any = None  # FlashInfer's planned wrapper, made on first use

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        backend: str = "auto",
        kv_cache: str = "auto",
        cuda_graphs: bool = True,
    ) -> LMRunner:
        """Load a checkpoint directory (weights + tokenizer), pick the attention backend and the KV
        cache (:func:`~common.runtime.kv_arena.select_kv_cache`: ``auto``, ``paged`` or ``contiguous``).
        ``cuda_graphs``: on CUDA with the paged arena, replay the passes that fit a bucket from CUDA
        graphs (:mod:`common.runtime.cuda_graphs`); elsewhere it changes nothing.

        Raises :class:`CheckpointError` (or :class:`UnsupportedArchitecture`) with the path in the
        message, and ``ValueError`` for an unknown dtype/backend/kv cache.
        """
        dtype = resolve_dtype(dtype, device)
        kv_mode, kv_reason = select_kv_cache(kv_cache, device, backend, dtype)
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r} (choose {', '.join(DTYPES)})")
        config = read_config(path)
        arch = check_architecture(config, path)
        draft_vocab = load_draft_vocab(path, config)
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        if backend == "flex" and not flex_available():
            raise ValueError("attention backend flex needs torch.nn.attention.flex_attention (torch 2.5 or later)")
        if backend == "flashinfer" and (reason := flashinfer_missing(device)) is not None:
            raise ValueError(reason)
        in_place = backend in ARENA_BACKENDS
        # flex and flashinfer attend the paged arena themselves; the dense backend then only names a fallback
        attention = pick_backend("sdpa" if in_place else backend, device, DTYPES[dtype], head_dim)
        tokenizer = load_tokenizer(path)
        model = load_causal_lm(path, dtype=dtype, device=device)
        runner = cls(
            model,
            attention,
            name=str(path),
            tokenizer_fp=tokenizer_fingerprint(tokenizer),
            draft_vocab=draft_vocab,
            kv_cache=kv_mode,
        )
        runner.paged_attention = backend if in_place else "sdpa"
        if cuda_graphs and torch.device(device).type == "cuda" and kv_mode == "paged" and not in_place:
            runner.graph_mode = "capture"
        log.info(
            "model_loaded",
            path=str(path),
            architecture=arch,
            dtype=dtype,
            device=device,
            attention_backend=runner.attention_name,
            requested_backend=backend,
            kv_cache=kv_mode,
            kv_cache_reason=kv_reason,
            cuda_graphs=runner.graph_mode == "capture",
        )
        return runner

    # ---- facts -------------------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        return (self.config.architectures or [SUPPORTED_MODEL_TYPES[self.config.model_type]])[0]

    @property
    def vocab_size(self) -> int:
        """Size of the id space the runner speaks (the target's, for a reduced draft vocabulary)."""
        return self.draft_vocab.target_vocab_size if self.draft_vocab is not None else self.config.vocab_size

    @property
    def max_context(self) -> int:
        return int(self.config.max_position_embeddings)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def attention_name(self) -> str:
        """What attends: the backend's name, or ``paged_sdpa`` / ``paged_flex`` / ``paged_flashinfer``
        on the paged arena."""
        return f"paged_{self.paged_attention}" if self.kv_cache == "paged" else self.backend.name

    def _flashinfer_kernel(self) -> tuple[Any, int, int, float]:
        """FlashInfer's wrapper (made once, with its workspace, on this runner's device) and the
        shapes each pass plans it for."""
        if self.flashinfer_wrapper is None:
            self.flashinfer_wrapper = new_flashinfer_wrapper(self.device)
        return self.flashinfer_wrapper, self.num_heads, self.head_dim, self.scale

    def new_pool(self, token_budget: int | None) -> KVPool | KVArena:
        """The caches' pool: a :class:`KVPool` (contiguous) or a :class:`KVArena` (paged), which on
        a GPU is allocated whole at start-up (fixed addresses, and an arena that does not fit fails
        then rather than under load)."""
        if self.kv_cache == "paged":
            return KVArena(
                num_layers=self.num_layers,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                dtype=self.dtype,
                device=self.device,
                token_budget=token_budget,
                preallocate=self.device.type == "cuda",
            )
        return KVPool(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.backend.cache_dtype or self.dtype,
            device=self.device,
            token_budget=token_budget,
        )

    def model_info(self) -> ModelInfo:
        return ModelInfo(
            model_name=self.name,
            architecture=self.architecture,
            vocab_size=self.vocab_size,
            tokenizer_fingerprint=self.tokenizer_fingerprint,
            num_parameters=self.num_parameters,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            attention_backend=self.attention_name,
            max_context=self.max_context,
        )

    # ---- forward -----------------------------------------------------------------------------

    def qkv(
        self, li: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``li``'s rotated queries and keys and its values for ``x`` (:func:`_qkv_of`)."""
        return _qkv_of(self, li, x, cos, sin)

    def mlp(self, li: int, h: torch.Tensor) -> torch.Tensor:
        """``h`` plus layer ``li``'s MLP of its normed ``h`` (the fused gate and up product when built)."""
        layer = self.layers[li]
        x = layer.post_attention_layernorm(h)
        if self.products is not None:
            gate, up = self.products[li].gate_up(x)
            return h + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
        return h + layer.mlp(x)

    def layout_of(self, seqs: Sequence[SeqInput]) -> BatchLayout:
        """The pass's layout; raises ``ValueError`` for a sequence without new tokens or with parents
        that do not match them."""
        parents = []
        for s in seqs:
            t = len(s.token_ids)
            if t == 0:
                raise ValueError("every sequence of a forward pass needs at least one new token")
            par = tuple(range(-1, t - 1)) if s.parents is None else tuple(s.parents)
            if len(par) != t:
                raise ValueError(f"{t} new tokens but {len(par)} parents")
            parents.append(par)
        return BatchLayout(past_lens=tuple(s.cache.length for s in seqs), parents=tuple(parents))

    def prepare(
        self, seqs: Sequence[SeqInput], layout: BatchLayout | None = None
    ) -> tuple[BatchLayout, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pass's layout (:meth:`layout_of`, unless the caller built it already), its packed token
        ids ``[N]`` (in the model's id space), their embeddings ``[N, hidden]`` and the rotary ``cos,
        sin: [N, 1, D]`` at positions ``cache length + depth``."""
        layout = self.layout_of(seqs) if layout is None else layout
        dev = self.device
        ids = torch.tensor([tok for s in seqs for tok in s.token_ids], dtype=torch.long, device=dev)
        if self.draft_vocab is not None:
            ids = self.draft_vocab.to_draft[ids]
        pos = torch.tensor([p for b in range(layout.batch) for p in layout.positions(b)], dtype=torch.long, device=dev)
        return (layout, ids, *self.embed_at(ids, pos))

    def embed_at(self, ids: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Embeddings ``[N, hidden]`` of ``ids: [N]`` (the model's id space) and the rotary ``cos, sin:
        [N, 1, D]`` at positions ``pos: [N]``."""
        h = self.embed(ids)
        cos, sin = self.rotary(h.unsqueeze(0), pos.unsqueeze(0))  # [1, N, D]
        return h, cos[0].unsqueeze(1), sin[0].unsqueeze(1)

    def layers_over(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Every layer over ``h: [N, hidden]``, attention by ``attend(layer, q, k, v) -> [N, H, D]``
        (which writes the new keys/values where its caches keep them): the final hidden states."""
        N, H, D = h.shape[0], self.num_heads, self.head_dim
        for li, layer in enumerate(self.layers):
            q, k, v = self.qkv(li, layer.input_layernorm(h), cos, sin)
            h = self.mlp(li, h + layer.self_attn.o_proj(attend(li, q, k, v).reshape(N, H * D)))
        return h

    @torch.inference_mode()
    def forward(self, seqs: Sequence[SeqInput]) -> list[torch.Tensor]:
        """One forward pass for the batch.

        Returns per sequence the float32 logits ``[len(logit_rows), vocab]`` of its requested rows.
        Every cache must have room for its new tokens (``cache.reserve(t)`` beforehand).
        """
        if not seqs:
            return []
        layout = None
        if self.graph_mode != "off" and isinstance(seqs[0].cache, PagedCache):
            out, layout = self._graph_pass(seqs)
            if out is not None:
                return out
        layout, ids, h, cos, sin = self.prepare(seqs, layout)
        if isinstance(seqs[0].cache, PagedCache):
            paged = PagedPass(
                [s.cache for s in seqs],  # type: ignore[misc]
                layout,
                h.dtype,
                self.paged_attention,
                self._flashinfer_kernel() if self.paged_attention == "flashinfer" else None,
            )

            def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return paged.attend(li, q, k, v, self.scale)

        else:
            attend = self._cache_attention(seqs, layout)
        h = self.layers_over(h, cos, sin, attend)
        return self.logits(h, seqs, layout)

    def _graph_pass(self, seqs: Sequence[SeqInput]) -> tuple[list[torch.Tensor] | None, BatchLayout]:
        """The pass replayed from a bucket's graph, or None: run it eagerly (:class:`PassGraphs`);
        with the pass's layout, which the eager pass then reuses."""
        arena = seqs[0].cache.arena  # type: ignore[union-attr]
        if self.graphs is None or self.graphs.arena is not arena:
            if self.graphs is not None:
                self.graphs.close()
            self.graphs = PassGraphs(self, arena, capture=self.graph_mode == "capture")
        ids = [tok for s in seqs for tok in s.token_ids]
        layout = self.layout_of(seqs)
        return self.graphs.run(seqs, layout, ids), layout

    def _cache_attention(
        self, seqs: Sequence[SeqInput], layout: BatchLayout
    ) -> Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """Each layer's attention over the requests' own caches through the backend: its plan built
        once for the pass; then per layer the new keys/values written (by the backend itself, all
        sequences at once, where it can) and attended, ``q: [N, H, D]`` -> ``[N, H, D]``."""
        plan = self.backend.plan(layout, self.device)
        offsets, lens = layout.offsets, layout.new_lens
        if self.backend.writes_new_kv:
            for s, t in zip(seqs, lens):
                s.cache.will_write(t)  # checks the room the views below need

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if self.backend.writes_new_kv:
                views = [s.cache.view(li, t) for s, t in zip(seqs, lens)]
                return self.backend.attend_writing(q, k, v, views, plan, self.scale)
            kvs = []
            for s, off, t in zip(seqs, offsets, lens):
                s.cache.write(li, k[off : off + t].transpose(0, 1), v[off : off + t].transpose(0, 1))
                kvs.append(s.cache.view(li, t))
            return self.backend.attend(q, kvs, plan, self.scale)

        return attend

    def logits(self, h: torch.Tensor, seqs: Sequence[SeqInput], layout: BatchLayout) -> list[torch.Tensor]:
        """Per sequence the float32 logits ``[len(logit_rows), vocab]`` of its wanted rows of the
        final hidden states ``h: [N, hidden]``."""
        rows, counts = [], []
        for s, off, t in zip(seqs, layout.offsets, layout.new_lens):
            want = (t - 1,) if s.logit_rows is None else s.logit_rows
            rows += [off + r for r in want]
            counts.append(len(want))
        logits = self.lm_head(self.norm(h[torch.tensor(rows, dtype=torch.long, device=self.device)])).float()
        if self.draft_vocab is not None:
            logits = self.draft_vocab.full_logits(logits)
        return list(torch.split(logits, counts))


def _qkv_of(runner: LMRunner, li: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Layer ``li``'s queries ``[N, H, D]`` and keys ``[N, Hkv, D]`` (rotated) and values ``[N, Hkv, D]``
    of the normed hidden states ``x: [N, hidden]``: with fused projections one product and one
    rotation for q and k together, else the model's own three."""
    N, H, Hkv, D = x.shape[0], runner.num_heads, runner.num_kv_heads, runner.head_dim
    if runner.products is not None:
        qkv = runner.products[li].qkv.linear(x)
        qk = _rope(qkv[:, : (H + Hkv) * D].view(N, H + Hkv, D), cos, sin)
        return qk[:, :H], qk[:, H:], qkv[:, (H + Hkv) * D :].view(N, Hkv, D)
    attn = runner.layers[li].self_attn
    q = _rope(attn.q_proj(x).view(N, H, D), cos, sin)
    k = _rope(attn.k_proj(x).view(N, Hkv, D), cos, sin)
    return q, k, attn.v_proj(x).view(N, Hkv, D)


def _pass_order(model: Any, products: Sequence[LayerProducts]) -> torch.nn.ModuleList:
    """The projections a pass calls, in its order: each layer's stacked q/k/v, o, stacked gate/up and
    down (their parts are no longer called), then lm_head."""
    order: list[torch.nn.Module] = []
    for layer, prod in zip(model.model.layers, products):
        order += [prod.qkv.linear, layer.self_attn.o_proj, prod.gate_up.linear, layer.mlp.down_proj]
    return torch.nn.ModuleList([*order, model.lm_head])


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on ``x: [N, heads, D]`` with ``cos, sin: [N, 1, D]`` (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
