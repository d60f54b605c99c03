import pytest

from services.gateway.requests import IncrementalDetokenizer, InvalidRequest, Limits, RawRequest, StopMatcher, validate

LIMITS = Limits(
    default_max_new_tokens=16,
    max_new_tokens_limit=64,
    max_prompt_tokens=8,
    max_stop_strings=2,
    vocab_size=100,
    max_context=40,
)


def raw(**kw):
    base = dict(
        prompt="hello",
        prompt_ids=None,
        max_new_tokens=0,
        temperature=None,
        top_p=None,
        top_k=None,
        seed=None,
        stop=(),
        request_id="",
        domain_hint="",
    )
    base.update(kw)
    return RawRequest(**base)


def tok(text):
    return [ord(c) % 100 for c in text]


def test_defaults_are_filled():
    req = validate(raw(), LIMITS, tok)
    assert req.prompt_ids == tuple(tok("hello")) and req.max_new_tokens == 16
    assert (req.temperature, req.top_p, req.top_k, req.seed) == (0.0, 1.0, 0, None)
    assert len(req.request_id) == 32


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(prompt=""), "prompt"),
        (dict(prompt="   "), "prompt"),
        (dict(prompt=None, prompt_ids=[]), "prompt_ids"),
        (dict(prompt=None), "prompt"),
        (dict(prompt=None, prompt_ids=[1, 100]), "prompt_ids"),
        (dict(prompt="x" * 9), "prompt"),
        (dict(prompt=None, prompt_ids=[1] * 9), "prompt_ids"),  # found by tests/fuzz: was blamed on "prompt"
        (dict(max_new_tokens=65), "max_new_tokens"),
        (dict(max_new_tokens=39), "max_new_tokens"),  # 5 + 39 > context 40
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(stop=("a", "b", "c")), "stop"),
        (dict(stop=("",)), "stop"),
        (dict(request_id="bad id!"), "request_id"),
        (dict(unknown_fields=(42,)), "request"),
    ],
)
def test_invalid_fields_are_named(kw, field):
    with pytest.raises(InvalidRequest) as info:
        validate(raw(**kw), LIMITS, tok)
    assert info.value.field == field
    assert str(info.value).startswith(field + ":")


def byte_tokenizer():
    """A byte-level tokenizer whose token id b is the byte b (GPT-2's byte-to-character table)."""
    from tokenizers import Tokenizer, decoders, models

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    tok = Tokenizer(models.WordLevel(vocab={c: b for b, c in chars.items()}, unk_token="!"))
    tok.decoder = decoders.ByteLevel()
    return tok


def utf8_decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def test_incremental_detokenizer_holds_back_partial_characters():
    data = "héllo ✓ ok".encode()
    d = IncrementalDetokenizer(byte_tokenizer())
    out = "".join(d.push([b]) for b in data) + d.flush()
    assert out == "héllo ✓ ok"
    d = IncrementalDetokenizer(byte_tokenizer())
    assert d.push(list("✓".encode())[:2]) == ""
    assert d.push(list("✓".encode())[2:]) == "✓"


def test_incremental_detokenizer_gives_out_what_the_tokenizer_decodes_including_a_broken_tail():
    for data in (b"ok \xe2\x9c", b"\x9c ok \xff", "é✓".encode() + b"\xe2"):
        d = IncrementalDetokenizer(byte_tokenizer())
        assert d.push(list(data)) + d.flush() == utf8_decode(list(data))


def test_a_primed_detokenizer_goes_on_where_the_chunked_one_stood():
    """A resumed stream: the text after the ids a client has does not depend on the chunks they
    came in, even when a chunk ended inside a character (its text before that was given out)."""
    data = list("ab✓c é🎉 d".encode())
    whole = utf8_decode(data)
    for cut in range(1, len(data)):
        for size in (1, 2, 3, 5):
            served = IncrementalDetokenizer(byte_tokenizer())
            had = "".join(served.push(data[i : min(i + size, cut)]) for i in range(0, cut, size))
            resumed = IncrementalDetokenizer(byte_tokenizer())
            resumed.push(data[:cut])  # what the client already has is not sent again
            rest = resumed.push(data[cut:]) + resumed.flush()
            assert had + rest == whole, (cut, size)


def test_stop_matcher_cuts_before_stop_and_holds_prefixes():
    m = StopMatcher(("END",))
    assert m.feed("abc E") == "abc "
    assert m.feed("N") == ""
    assert m.feed("X") == "ENX"
    assert m.feed("tail EN") == "tail "
    assert m.feed("D more") == "" and m.stopped
    assert m.feed("ignored") == "" and m.flush() == ""
    m = StopMatcher(("\n\n", "###"))
    assert m.feed("a\n") == "a" and m.flush() == "\n"


def test_resume_ids_are_checked_and_kept():
    assert validate(raw(resume_ids=[5, 6]), LIMITS, tok).resume_ids == (5, 6)
    with pytest.raises(InvalidRequest) as err:
        validate(raw(resume_ids=[5, 100]), LIMITS, tok)
    assert err.value.field == "resume_ids"
    with pytest.raises(InvalidRequest) as err:  # nothing left to generate
        validate(raw(max_new_tokens=2, resume_ids=[5, 6]), LIMITS, tok)
    assert err.value.field == "resume_ids"


@pytest.mark.parametrize(
    "kw,field", [(dict(top_k=2**32), "top_k"), (dict(seed=2**64), "seed"), (dict(seed=-1), "seed")]
)
def test_numbers_beyond_the_wire_types_are_refused(kw, field):
    """The HTTP front takes JSON integers of any size; the router's fields are 32/64-bit."""
    with pytest.raises(InvalidRequest) as err:
        validate(raw(**kw), LIMITS, tok)
    assert err.value.field == field


def test_logprobs_up_to_the_limit():
    """Unset asks for none; 0 to the limit are kept; past it (or negative) is refused naming the field."""
    assert validate(raw(), LIMITS, tok).logprobs == -1
    assert validate(raw(logprobs=0), LIMITS, tok).logprobs == 0
    assert validate(raw(logprobs=LIMITS.max_logprobs), LIMITS, tok).logprobs == LIMITS.max_logprobs
    for bad in (LIMITS.max_logprobs + 1, -1):
        with pytest.raises(InvalidRequest) as err:
            validate(raw(logprobs=bad), LIMITS, tok)
        assert err.value.field == "logprobs" and str(LIMITS.max_logprobs) in str(err.value)


def test_penalties_in_range_are_kept_and_others_refused_by_name():
    """Unset: off (0, 0, 1); presence and frequency in [-2, 2], repetition finite and > 0."""
    plain = validate(raw(), LIMITS, tok)
    assert (plain.presence_penalty, plain.frequency_penalty, plain.repetition_penalty) == (0.0, 0.0, 1.0)
    assert plain.sampling().repetition_penalty == 1.0
    kept = validate(raw(presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.5), LIMITS, tok)
    assert kept.sampling().presence_penalty == -2.0 and kept.sampling().frequency_penalty == 2.0
    assert kept.sampling().repetition_penalty == 0.5 and kept.params()["repetition_penalty"] == 0.5
    bad = [
        ("presence_penalty", 2.01),
        ("presence_penalty", float("nan")),
        ("frequency_penalty", -2.5),
        ("frequency_penalty", float("inf")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", float("inf")),
        ("repetition_penalty", float("nan")),
    ]
    for name, value in bad:
        with pytest.raises(InvalidRequest) as err:
            validate(raw(**{name: value}), LIMITS, tok)
        assert err.value.field == name, (name, value)
