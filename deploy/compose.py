"""Load a docker-compose file the way Compose does for checking it offline: read the env file,
interpolate ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?error}``, ``${VAR?error}``,
``$VAR`` and ``$$``, resolve YAML merge keys, and validate the result against the Compose
Specification JSON schema (the copy shipped by the check-jsonschema package)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))"
)


class InterpolationError(ValueError):
    pass


def read_env_file(path: str | Path) -> dict[str, str]:
    """KEY=VALUE lines; # comments and blank lines ignored; optional surrounding quotes removed."""
    out: dict[str, str] = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise InterpolationError(f"{path}: not KEY=VALUE: {line!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key.strip()] = value
    return out


def interpolate_string(text: str, env: Mapping[str, str], used: set[str] | None = None) -> str:
    def sub(m: re.Match) -> str:
        if m.group("escaped"):
            return "$"
        name = m.group("braced") or m.group("named")
        if used is not None:
            used.add(name)
        op, arg = m.group("op"), m.group("arg") or ""
        value = env.get(name)
        unset_or_empty = value is None or (value == "" and op is not None and op.startswith(":"))
        if op in (":-", "-"):
            return interpolate_string(arg, env, used) if (value is None if op == "-" else unset_or_empty) else value
        if op in (":?", "?"):
            if value is None if op == "?" else unset_or_empty:
                raise InterpolationError(f"required variable {name} is missing: {arg}")
            return value
        return value or ""

    return _VAR.sub(sub, text)


def interpolate(node: Any, env: Mapping[str, str], used: set[str] | None = None) -> Any:
    if isinstance(node, str):
        return interpolate_string(node, env, used)
    if isinstance(node, list):
        return [interpolate(x, env, used) for x in node]
    if isinstance(node, dict):
        return {k: interpolate(v, env, used) for k, v in node.items()}
    return node


def load(path: str | Path, env: Mapping[str, str], used: set[str] | None = None) -> dict[str, Any]:
    """Parse ``path`` (merge keys resolved) and interpolate it with ``env``."""
    raw = yaml.safe_load(Path(path).read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a YAML mapping")
    return interpolate(raw, env, used)


def compose_schema() -> dict[str, Any]:
    from importlib.resources import files

    return json.loads((files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text())


def schema_errors(doc: Mapping[str, Any]) -> list[str]:
    """Compose Specification violations in ``doc`` (empty when valid)."""
    import jsonschema

    schema = compose_schema()
    validator_cls = jsonschema.validators.validator_for(schema)
    validator = validator_cls(schema)
    return [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in validator.iter_errors(doc)]
