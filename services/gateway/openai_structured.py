"""Structured output in the OpenAI API: the request fields that constrain the output, as one
:class:`Constraint` (no HTTP here; the verifier applies it, ``common.spec.grammar``).

- OpenAI's ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}`` (any
  JSON object) or ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``;
- vLLM's ``structured_outputs`` extension, one of ``{"json": schema}``, ``{"regex": "..."}``,
  ``{"grammar": "..."}`` (Lark or GBNF) or ``{"choice": ["...", ...]}``, and its older spellings
  ``guided_json``, ``guided_regex``, ``guided_grammar`` and ``guided_choice``, which clients still send.

At most one of them per request. Whether the grammar compiles is the gateway's next check
(``GatewayApp.admit``), against the target's tokenizer, so a bad schema is a 400 naming the
field it came in with and the grammar engine's reason.
"""

from __future__ import annotations

import json
from typing import Any

from common.spec.types import Constraint
from services.gateway.requests import InvalidRequest

# vLLM's structured_outputs keys (and guided_<key>) -> our constraint kinds
KINDS = {"json": "json_schema", "regex": "regex", "grammar": "grammar", "choice": "choice"}


def constraint_of(body: Any) -> tuple[Constraint | None, str]:
    """The request's constraint and the field it came in (``(None, "")``: none); raises
    :class:`InvalidRequest` naming a malformed field, or the second of two."""
    found: list[tuple[Constraint, str]] = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        c = _response_format(response_format)
        if c is not None:
            found.append((c, "response_format"))
    structured = getattr(body, "structured_outputs", None)
    if structured is not None:
        if not isinstance(structured, dict):
            raise InvalidRequest("structured_outputs", "must be an object")
        given = {k: v for k, v in structured.items() if k in KINDS and v is not None}
        if len(given) != 1:
            raise InvalidRequest("structured_outputs", f"give exactly one of {', '.join(KINDS)}")
        [(key, value)] = given.items()
        found.append((_extension(key, value, "structured_outputs"), "structured_outputs"))
    extra = getattr(body, "model_extra", None) or {}
    for key in KINDS:
        value = extra.get(f"guided_{key}")
        if value is not None:
            found.append((_extension(key, value, f"guided_{key}"), f"guided_{key}"))
    if len(found) > 1:
        raise InvalidRequest(found[1][1], f"one constraint per request (also given: {found[0][1]})")
    return found[0] if found else (None, "")


def _response_format(value: Any) -> Constraint | None:
    if not isinstance(value, dict):
        raise InvalidRequest("response_format", "must be an object with a type")
    kind = value.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequest("response_format", "json_schema.schema must be a JSON schema (an object)")
        return Constraint("json_schema", json.dumps(schema))
    raise InvalidRequest("response_format", f"type must be text, json_object or json_schema (got {kind!r})")


def _extension(key: str, value: Any, field_name: str) -> Constraint:
    """A vLLM-style field as a constraint: a schema or a list of choices given as JSON is written
    out as JSON text; whether it is a schema, a list of strings, a regex that parses is the
    grammar's compile to say (``common.spec.grammar``, at admission, naming ``field_name``)."""
    kind = KINDS[key]
    if kind in ("json_schema", "choice") and not isinstance(value, str):
        value = json.dumps(value)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(field_name, f"must be a non-empty {key}")
    return Constraint(kind, value)
