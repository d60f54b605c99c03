"""Hypothesis strategies for the gateway's and the router's requests, as plain specs.

A spec is transport-neutral (a frozen dataclass of plain values); ``to_pb`` renders it as the
bytes a gRPC client would send (unknown fields appended as raw length-delimited fields). A JSON
rendering for the HTTP API would sit beside it. Three kinds of case per request type:

- **valid**: within every limit of the fuzzed cluster (``tests/fuzz/stack.py``): must succeed;
- **one bad field**: a valid case with exactly one field broken: must be refused naming that field;
- **wild**: anything at all (any unicode, extreme integers, NaN/inf, unknown fields): must succeed
  or be refused naming some field, and never crash, hang or leak.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, replace

from hypothesis import strategies as st

from cosine.v1 import gateway_pb2, router_pb2

from .stack import GATEWAY_LIMITS, MAX_CONTEXT, VOCAB_SIZE

# ---- building blocks -----------------------------------------------------------------------

TEXT = st.text(alphabet=st.characters(codec="utf-8"))  # any unicode a protobuf string can carry
INT32 = st.one_of(
    st.integers(-(2**31), 2**31 - 1), st.sampled_from([-(2**31), -1, 0, VOCAB_SIZE - 1, VOCAB_SIZE, 2**31 - 1])
)
UINT32 = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 2**31, 2**32 - 1]))
UINT64 = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 2**63, 2**64 - 1]))
DOUBLE = st.one_of(
    st.floats(), st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0, 5e-324, 1e-300, 1e308])
)
BAD_PROB = st.one_of(
    st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    st.floats(max_value=-1e-9),
    st.floats(min_value=1.0001),
)
TOKEN = st.integers(0, VOCAB_SIZE - 1)
BAD_TOKEN = st.one_of(st.integers(-(2**31), -1), st.integers(VOCAB_SIZE, 2**31 - 1))
ID_CHARS = string.ascii_letters + string.digits + "-_.:"
REQUEST_ID = st.text(alphabet=ID_CHARS, min_size=1, max_size=64)
BAD_REQUEST_ID = st.one_of(
    st.text(alphabet=ID_CHARS, min_size=129, max_size=300),
    st.tuples(
        st.text(alphabet=ID_CHARS, max_size=8),
        st.sampled_from([" ", "/", "!", "\x00", "\n", "😀", "{", "*"]),
        st.text(alphabet=ID_CHARS, max_size=8),
    ).map("".join),
)
# valid but extreme: any finite temperature >= 0 (subnormals and 1e308 included), any top_p in (0, 1]
TEMPERATURE = st.one_of(
    st.just(0.0),
    st.floats(0.05, 2.0),
    st.floats(min_value=0.0, allow_infinity=False),
    st.sampled_from([5e-324, 1e-300, 1e-8, 1e308]),
)
TOP_P = st.one_of(st.floats(0.05, 1.0), st.floats(min_value=0.0, max_value=1.0), st.sampled_from([5e-324, 1e-12, 1.0]))
DOMAIN_HINT = st.one_of(
    st.just(""),
    st.sampled_from(["code", "prose", "arithmetic", "records"]),
    st.text(alphabet=string.ascii_lowercase, max_size=12),
)


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def unknown_field(number: int, payload: bytes) -> bytes:
    """A length-delimited field the schema does not know (what a newer client would send)."""
    return varint((number << 3) | 2) + varint(len(payload)) + payload


def unknown_fields(message: type) -> st.SearchStrategy[tuple[tuple[int, bytes], ...]]:
    """Fields ``message`` does not know (numbers outside its schema and the reserved range)."""
    known = set(message.DESCRIPTOR.fields_by_number)
    number = st.integers(1, 2**29 - 1).filter(lambda n: n not in known and not 19000 <= n <= 19999)
    return st.lists(st.tuples(number, st.binary(max_size=16)), min_size=1, max_size=3).map(tuple)


def field_paths(message: type) -> frozenset[str]:
    """Every field path of ``message`` (``items``, ``items.tree.parents``...): what a refusal of
    bytes that do not parse may name, besides ``request``."""

    def walk(desc, prefix: str) -> set[str]:
        out: set[str] = set()
        for f in desc.fields:
            path = f"{prefix}{f.name}"
            out.add(path)
            if f.message_type is not None and not f.message_type.GetOptions().map_entry:
                out |= walk(f.message_type, path + ".")
        return out

    return frozenset({"request", *walk(message.DESCRIPTOR, "")})


def mutated(valid: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """Random bytes, or serialized messages with bytes overwritten, inserted or cut off."""

    def mutate(args: tuple[bytes, list[tuple[int, int]], int, bytes]) -> bytes:
        data, edits, cut, insert = args
        buf = bytearray(data)
        for pos, value in edits:
            if buf:
                buf[pos % len(buf)] = value
        at = cut % (len(buf) + 1)
        return bytes(buf[:at]) + insert + bytes(buf[at:]) if cut % 3 else bytes(buf[:at])

    return st.one_of(
        st.binary(max_size=256),
        st.tuples(
            valid,
            st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4),
            st.integers(0, 10**6),
            st.binary(max_size=8),
        ).map(mutate),
    )


# ---- gateway: GenerateRequest ----------------------------------------------------------------

GATEWAY_FIELDS = field_paths(gateway_pb2.GenerateRequest)


@dataclass(frozen=True)
class GenerateSpec:
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    max_new_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    request_id: str = ""
    domain_hint: str = ""
    unknown: tuple[tuple[int, bytes], ...] = ()
    expect_field: str | None = None  # built bad in this one field: the refusal must name it

    def to_pb(self) -> bytes:
        msg = gateway_pb2.GenerateRequest(
            max_new_tokens=self.max_new_tokens,
            stop=list(self.stop),
            request_id=self.request_id,
            domain_hint=self.domain_hint,
        )
        if self.prompt is not None:
            msg.prompt = self.prompt
        elif self.prompt_ids is not None:
            msg.prompt_ids.ids.extend(self.prompt_ids)
            msg.prompt_ids.SetInParent()
        for name in ("temperature", "top_p", "top_k", "seed"):
            if getattr(self, name) is not None:
                setattr(msg, name, getattr(self, name))
        return msg.SerializeToString() + b"".join(unknown_field(n, p) for n, p in self.unknown)


_valid_prompt = st.one_of(
    # at most 12 characters: even 4 UTF-8 bytes each stay within the 64-token limit
    st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=12).filter(lambda s: s.strip()),
    st.lists(st.sampled_from(["def", "f(x):", "return", "the", "cat", "1 + 2 =", "name:"]), min_size=1, max_size=8).map(
        "\n".join
    ),
)
VALID_GENERATE = st.builds(
    GenerateSpec,
    prompt=_valid_prompt,
    max_new_tokens=st.integers(0, GATEWAY_LIMITS["max_new_tokens_limit"]),
    temperature=st.one_of(st.none(), TEMPERATURE),
    top_p=st.one_of(st.none(), TOP_P),
    top_k=st.one_of(st.none(), UINT32),
    seed=st.one_of(st.none(), UINT64),
    stop=st.lists(
        st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=6),
        max_size=GATEWAY_LIMITS["max_stop_strings"],
    ).map(tuple),
    request_id=st.one_of(st.just(""), REQUEST_ID),
    domain_hint=DOMAIN_HINT,
)
VALID_GENERATE = st.one_of(
    VALID_GENERATE,
    st.tuples(VALID_GENERATE, st.lists(TOKEN, min_size=1, max_size=GATEWAY_LIMITS["max_prompt_tokens"])).map(
        lambda t: replace(t[0], prompt=None, prompt_ids=tuple(t[1]))
    ),
)

_too_long = GATEWAY_LIMITS["max_prompt_tokens"] + 1
_bad_generate_fields = {
    "prompt": st.sampled_from(
        [dict(prompt=""), dict(prompt=" \t\n"), dict(prompt=None, prompt_ids=None), dict(prompt="word " * 80)]
    ),
    "prompt_ids": st.one_of(
        st.just(dict(prompt=None, prompt_ids=())),
        st.tuples(st.lists(TOKEN, max_size=4), BAD_TOKEN).map(lambda t: dict(prompt=None, prompt_ids=(*t[0], t[1]))),
        st.integers(_too_long, 4 * _too_long).map(lambda n: dict(prompt=None, prompt_ids=(1,) * n)),
    ),
    "max_new_tokens": st.integers(GATEWAY_LIMITS["max_new_tokens_limit"] + 1, 2**32 - 1).map(
        lambda n: dict(max_new_tokens=n)
    ),
    "temperature": st.one_of(
        st.sampled_from([float("nan"), float("inf"), float("-inf")]), st.floats(max_value=-1e-12)
    ).map(lambda v: dict(temperature=v)),
    "top_p": BAD_PROB.map(lambda v: dict(top_p=v)),
    "stop": st.one_of(
        st.lists(st.text(min_size=1, max_size=3), min_size=GATEWAY_LIMITS["max_stop_strings"] + 1, max_size=10),
        st.lists(st.text(min_size=1, max_size=3), max_size=2).map(lambda s: [*s, ""]),
    ).map(lambda s: dict(stop=tuple(s))),
    "request_id": BAD_REQUEST_ID.map(lambda r: dict(request_id=r)),
    "request": unknown_fields(gateway_pb2.GenerateRequest).map(lambda u: dict(unknown=u)),
}
BAD_GENERATE_FIELDS = sorted(_bad_generate_fields)


def one_bad_generate(name: str) -> st.SearchStrategy[GenerateSpec]:
    """A valid request broken in field ``name`` only."""
    return st.tuples(VALID_GENERATE, _bad_generate_fields[name]).map(lambda t: replace(t[0], **t[1], expect_field=name))


WILD_GENERATE = st.builds(
    GenerateSpec,
    prompt=st.one_of(st.none(), TEXT, st.text(max_size=2000)),
    prompt_ids=st.one_of(st.none(), st.lists(INT32, max_size=100).map(tuple)),
    max_new_tokens=UINT32,
    temperature=st.one_of(st.none(), DOUBLE),
    top_p=st.one_of(st.none(), DOUBLE),
    top_k=st.one_of(st.none(), UINT32),
    seed=st.one_of(st.none(), UINT64),
    stop=st.lists(TEXT, max_size=6).map(tuple),
    request_id=st.one_of(TEXT, REQUEST_ID),
    domain_hint=st.one_of(TEXT, DOMAIN_HINT),
    unknown=st.one_of(st.just(()), unknown_fields(gateway_pb2.GenerateRequest)),
)
RAW_GENERATE = mutated(VALID_GENERATE.map(GenerateSpec.to_pb))


# ---- router: SubmitRequest -------------------------------------------------------------------

SUBMIT_FIELDS = field_paths(router_pb2.SubmitRequest)


@dataclass(frozen=True)
class SubmitSpec:
    request_id: str = "r"
    prompt_ids: tuple[int, ...] = (1,)
    max_new_tokens: int = 1
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    domain_hint: str = ""
    expect_field: str | None = None

    def to_pb(self) -> bytes:
        msg = router_pb2.SubmitRequest(
            request_id=self.request_id,
            prompt_ids=self.prompt_ids,
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=self.stop_token_ids,
            domain_hint=self.domain_hint,
        )
        msg.sampling.temperature, msg.sampling.top_p, msg.sampling.top_k = self.temperature, self.top_p, self.top_k
        if self.seed is not None:
            msg.sampling.seed = self.seed
        return msg.SerializeToString()


VALID_SUBMIT = st.builds(
    SubmitSpec,
    request_id=REQUEST_ID,
    prompt_ids=st.lists(TOKEN, min_size=1, max_size=64).map(tuple),
    max_new_tokens=st.integers(1, 8),
    temperature=TEMPERATURE,
    top_p=TOP_P,
    top_k=UINT32,
    seed=st.one_of(st.none(), UINT64),
    stop_token_ids=st.lists(TOKEN, max_size=3).map(tuple),
    domain_hint=DOMAIN_HINT,
)
_bad_submit_fields = {
    "request_id": st.one_of(st.just(""), BAD_REQUEST_ID).map(lambda r: dict(request_id=r)),
    "prompt_ids": st.one_of(
        st.just(dict(prompt_ids=())),
        st.tuples(st.lists(TOKEN, max_size=4), BAD_TOKEN).map(lambda t: dict(prompt_ids=(*t[0], t[1]))),
        st.integers(MAX_CONTEXT, 3 * MAX_CONTEXT).map(lambda n: dict(prompt_ids=(1,) * n)),
    ),
    "max_new_tokens": st.one_of(st.just(0), st.integers(MAX_CONTEXT, 2**32 - 1)).map(lambda n: dict(max_new_tokens=n)),
    "sampling.temperature": st.one_of(
        st.sampled_from([float("nan"), float("inf"), float("-inf")]), st.floats(max_value=-1e-12)
    ).map(lambda v: dict(temperature=v)),
    "sampling.top_p": BAD_PROB.map(lambda v: dict(top_p=v)),
    "stop_token_ids": st.tuples(st.lists(TOKEN, max_size=2), BAD_TOKEN).map(
        lambda t: dict(stop_token_ids=(*t[0], t[1]))
    ),
}
BAD_SUBMIT_FIELDS = sorted(_bad_submit_fields)


def one_bad_submit(name: str) -> st.SearchStrategy[SubmitSpec]:
    """A valid submission broken in field ``name`` only."""
    return st.tuples(VALID_SUBMIT, _bad_submit_fields[name]).map(lambda t: replace(t[0], **t[1], expect_field=name))


WILD_SUBMIT = st.builds(
    SubmitSpec,
    request_id=st.one_of(TEXT, REQUEST_ID),
    prompt_ids=st.one_of(st.lists(INT32, max_size=80), st.lists(TOKEN, min_size=1, max_size=80)).map(tuple),
    max_new_tokens=st.one_of(UINT32, st.integers(1, 8)),
    temperature=DOUBLE,
    top_p=DOUBLE,
    top_k=UINT32,
    seed=st.one_of(st.none(), UINT64),
    stop_token_ids=st.lists(INT32, max_size=4).map(tuple),
    domain_hint=st.one_of(TEXT, DOMAIN_HINT),
)
RAW_SUBMIT = mutated(VALID_SUBMIT.map(SubmitSpec.to_pb))
