"""The ``logprobs`` objects of the OpenAI-compatible HTTP API, built from the target's figures the
router streams (:class:`common.spec.types.TokenLogprob`: the model's raw log-probabilities).

Completions (the legacy shape): ``{tokens, token_logprobs, top_logprobs, text_offset}``, where each
``top_logprobs`` entry maps token text to logprob, the ``logprobs`` most probable first, plus the
chosen token when it is not among them (as OpenAI: "up to logprobs + 1 elements"); ``text_offset``
is each token's first character in the completion's text. Chat: ``{content: [{token, logprob,
bytes, top_logprobs: [{token, logprob, bytes}]}], refusal: null}``.

A token's text is the tokenizer's decoding of that token alone (a token holding part of a
multi-byte character decodes to U+FFFD, as in other servers), its ``bytes`` the raw bytes the token
stands for when the gateway knows them (``token_bytes``: so a character split over tokens is whole
again in the concatenated bytes, as OpenAI's are), else that text's UTF-8.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from common.spec.types import TokenLogprob


class TokenTexts:
    """Token ids as text, one token at a time (cached: the same ids recur across positions)."""

    def __init__(self, tokenizer: Any, token_bytes: Callable[[int], bytes] | None = None):
        self.tokenizer = tokenizer
        self.token_bytes = token_bytes
        self.special = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
        self._cache: dict[int, str] = {}

    def raw(self, token: int) -> bytes:
        """The bytes the token stands for (its text's UTF-8 when they are not known)."""
        return self.token_bytes(token) if self.token_bytes is not None else self(token).encode("utf-8")

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            text = self._cache[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def shown(self, token: int) -> int:
        """Characters the token adds to the response's text (special tokens are not shown)."""
        return 0 if token in self.special else len(self(token))


class CompletionLogprobs:
    """Builds completions' ``logprobs`` objects; ``text_offset`` runs on across the calls of one
    response (a stream's chunks)."""

    def __init__(self, texts: TokenTexts, top: int):
        self.texts = texts
        self.top = top
        self.offset = 0

    def build(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        tokens, offsets, tops = [], [], []
        for e in entries:
            tokens.append(self.texts(e.token))
            offsets.append(self.offset)
            self.offset += self.texts.shown(e.token)
            best: dict[str, float] = {}
            for t, lp in e.top[: self.top]:
                best.setdefault(self.texts(t), lp)
            best.setdefault(self.texts(e.token), e.logprob)
            tops.append(best)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def _entry(texts: TokenTexts, token: int, logprob: float) -> dict[str, Any]:
    text = texts(token)
    return {"token": text, "logprob": logprob, "bytes": list(texts.raw(token))}


def chat_logprobs(texts: TokenTexts, entries: Sequence[TokenLogprob], top: int) -> dict[str, Any]:
    """Chat completions' ``logprobs`` object for ``entries`` (a whole reply or one chunk's tokens)."""
    content = []
    for e in entries:
        item = _entry(texts, e.token, e.logprob)
        item["top_logprobs"] = [_entry(texts, t, lp) for t, lp in e.top[:top]]
        content.append(item)
    return {"content": content, "refusal": None}


Shaper = Callable[[Sequence[TokenLogprob]], "dict[str, Any] | None"]


def shaper(tokenizer: Any, top: int | None, chat: bool, token_bytes: Callable[[int], bytes] | None = None) -> Shaper:
    """What one response's choices carry as ``logprobs`` for the entries of its tokens: None when
    the request asked for none (``top`` None), else the completions' or the chat's object."""
    if top is None:
        return lambda entries: None
    texts = TokenTexts(tokenizer, token_bytes)
    if chat:
        return lambda entries: chat_logprobs(texts, entries, top)
    return CompletionLogprobs(texts, top).build
