"""The zoo's byte-level BPE tokenizer, trained with ``tokenizers`` and saved for transformers.

Conventions every zoo model shares (and that any replacement tokenizer is checked against):

- byte-level: ``decode(encode(text), skip_special_tokens=True) == text`` for every string;
- ``tokenizer(text).input_ids`` always starts with BOS (``<s>``) and never ends with EOS;
- training documents are ``<s> text </s>``; ``<pad>`` pads batches and is never trained on.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD, BOS, EOS)


def train_tokenizer(texts: Iterable[str], vocab_size: int, max_length: int = 1024) -> Any:
    """Train a byte-level BPE on ``texts`` and wrap it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer: Any, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))


def encode_documents(tokenizer: Any, docs: Iterable[str]) -> list[int]:
    """One token stream: ``<s> doc </s>`` for each document, concatenated."""
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for ids in tokenizer(list(docs), add_special_tokens=True, verbose=False)["input_ids"]:
        stream.extend(ids)
        stream.append(eos)
    return stream


def check_conventions(tokenizer: Any, sample: str = "def f(x):\n    return x + 1  # ü\n") -> None:
    """Raise ValueError when the tokenizer breaks the conventions in the module docstring."""
    ids = tokenizer(sample).input_ids
    if not ids or ids[0] != tokenizer.bos_token_id:
        raise ValueError("tokenizer does not start input_ids with BOS")
    if ids[-1] == tokenizer.eos_token_id:
        raise ValueError("tokenizer appends EOS to input_ids")
    if tokenizer.decode(ids, skip_special_tokens=True) != sample:
        raise ValueError("tokenizer does not roundtrip text")
    if tokenizer.pad_token_id is None:
        raise ValueError("tokenizer has no PAD token")
