"""The chat ``logprobs`` object's ``bytes``: a character split over tokens is whole again in them."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from common.spec.grammar import Grammars
from common.spec.types import TokenLogprob
from services.gateway.openai_logprobs import shaper


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with too few merges to hold a CJK character in one token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["hello world, hello there"] * 50, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def test_chat_logprobs_bytes_are_the_tokens_raw_bytes():
    tok = byte_level_tokenizer()
    text = "hello 日本"
    ids = tok.encode(text)
    grammars = Grammars(lambda: tok, len(tok))
    content = shaper(tok, 0, chat=True, token_bytes=grammars.token_bytes)([TokenLogprob(t, -0.5) for t in ids])[
        "content"
    ]
    assert any("\ufffd" in c["token"] for c in content)  # some token holds a piece of a character
    assert b"".join(bytes(c["bytes"]) for c in content).decode("utf-8") == text
    # without the raw bytes each piece would be U+FFFD's UTF-8, and the text could not be rebuilt
    plain = shaper(tok, 0, chat=True)([TokenLogprob(t, -0.5) for t in ids])["content"]
    assert b"".join(bytes(c["bytes"]) for c in plain).decode("utf-8") != text
