"""One frozen settings object per service, loaded once at start-up and passed down.

A settings class is a frozen dataclass whose fields are declared with :func:`setting`. Every
field can be given as a command-line flag (``--field-name``) or as an environment variable
(``COSINE_FIELD_NAME``); the flag wins over the variable, the variable over the default.
Values are converted to the field's type and validated; a bad value raises
:class:`SettingsError` with a message that names the flag and the variable, so a service can
print one clear line and exit non-zero.

Nothing here reads the environment at import time: :func:`load_settings` is given ``argv`` and
``environ`` explicitly (defaulting to the process's at call time).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

ENV_PREFIX = "COSINE_"

T = TypeVar("T")


class SettingsError(ValueError):
    """A setting is missing, malformed or out of range. The message is meant for the operator."""


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    choices: Sequence[Any] | None = None,
    check: Callable[[Any], str | None] | None = None,
    metavar: str | None = None,
) -> Any:
    """Declare a settings field.

    ``check`` returns an error message (without the field name) for an invalid value, or None.
    List-valued fields (``tuple[str, ...]``) are given as repeated flags or as a comma-separated
    environment variable.
    """
    meta = {"help": help, "choices": tuple(choices) if choices else None, "check": check, "metavar": metavar}
    if isinstance(default, (list, dict, set)):
        raise TypeError("use an immutable default (tuple) for settings fields")
    return dataclasses.field(default=default, metadata=meta)


# ---- reusable checks -------------------------------------------------------------------------


def port_check(value: int) -> str | None:
    return None if 0 <= value <= 65535 else "must be a port number between 0 and 65535"


def positive(value: float) -> str | None:
    return None if value > 0 else "must be greater than 0"


def non_negative(value: float) -> str | None:
    return None if value >= 0 else "must be 0 or greater"


def in_range(lo: float, hi: float) -> Callable[[float], str | None]:
    def check(value: float) -> str | None:
        return None if lo <= value <= hi else f"must be between {lo} and {hi}"

    return check


def redis_url_check(value: str) -> str | None:
    if value and not value.startswith(("redis://", "rediss://", "unix://")):
        return "must be a redis://, rediss:// or unix:// URL"
    return None


# ---- loading ---------------------------------------------------------------------------------


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one SettingsError instead of usage + exit."""

    def error(self, message: str) -> typing.NoReturn:  # pragma: no cover - exercised via SettingsError
        raise SettingsError(f"{message} (see --help)")


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _base_type(tp: Any) -> tuple[Any, bool, bool]:
    """Return (scalar type, is_tuple, is_optional) for a field annotation."""
    origin = typing.get_origin(tp)
    optional = False
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        tp = args[0]
        origin = typing.get_origin(tp)
    if origin is tuple:
        return typing.get_args(tp)[0], True, optional
    return tp, False, optional


def _convert(raw: str, tp: Any, source: str) -> Any:
    try:
        if tp is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        if tp is int:
            return int(raw)
        if tp is float:
            return float(raw)
        return str(raw)
    except ValueError:
        kind = {bool: "true/false", int: "an integer", float: "a number"}.get(tp, "a string")
        raise SettingsError(f"{source}: {raw!r} is not {kind}") from None


def build_parser(cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog=prog,
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=f"Every flag can also be set with an environment variable {ENV_PREFIX}<FLAG_NAME> "
        f"(e.g. --redis-url -> {ENV_PREFIX}REDIS_URL); a flag wins over the variable.",
    )
    types = _field_types(cls)
    for f in dataclasses.fields(cls):
        tp, is_tuple, _ = _base_type(types[f.name])
        meta = f.metadata
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS}
        help_text = meta.get("help", "")
        help_text += f" [env {env_name(f.name)}]"
        if f.default is not dataclasses.MISSING:
            shown = ",".join(map(str, f.default)) if is_tuple else f.default
            help_text += f" (default: {shown!r})" if shown not in ("", None) else ""
        else:
            help_text += " (required)"
        kwargs["help"] = help_text.replace("%", "%%")
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = meta.get("metavar") or f.name.upper()
            if is_tuple:
                kwargs["action"] = "append"
            if meta.get("choices"):
                kwargs["choices"] = [str(c) for c in meta["choices"]]
        parser.add_argument(flag_name(f.name), **kwargs)
    return parser


def load_settings(
    cls: type[T],
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    prog: str | None = None,
    description: str = "",
) -> T:
    """Build a frozen ``cls`` from flags (``argv``), ``COSINE_*`` variables and defaults.

    ``--help`` prints the help and raises SystemExit(0) as usual; anything invalid raises
    SettingsError with a single-line message.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    environ = os.environ if environ is None else environ
    parser = build_parser(cls, prog or cls.__name__, description)
    parsed = vars(parser.parse_args(argv))
    types = _field_types(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp, is_tuple, optional = _base_type(types[f.name])
        source = flag_name(f.name)
        if f.name in parsed:
            raw = parsed[f.name]
            if is_tuple:
                items: list[str] = []
                for chunk in raw:
                    items.extend(p for p in str(chunk).split(",") if p.strip())
                value: Any = tuple(_convert(p.strip(), tp, source) for p in items)
            elif tp is bool:
                value = bool(raw)
            else:
                value = _convert(raw, tp, source)
        elif env_name(f.name) in environ:
            source = env_name(f.name)
            raw = environ[env_name(f.name)]
            if is_tuple:
                value = tuple(_convert(p.strip(), tp, source) for p in raw.split(",") if p.strip())
            else:
                value = _convert(raw, tp, source)
        elif f.default is not dataclasses.MISSING:
            value = f.default
        else:
            raise SettingsError(f"{flag_name(f.name)} (or {env_name(f.name)}) is required")
        if value is None and optional:
            values[f.name] = None
            continue
        choices = f.metadata.get("choices")
        if choices and not is_tuple and value not in choices:
            raise SettingsError(f"{source}: {value!r} is not one of {', '.join(map(str, choices))}")
        check = f.metadata.get("check")
        if check is not None:
            for item in value if is_tuple else (value,):
                problem = check(item)
                if problem:
                    raise SettingsError(f"{source}: {item!r} {problem}")
        values[f.name] = value
    settings = cls(**values)
    post = getattr(settings, "validate", None)
    if callable(post):
        problem = post()
        if problem:
            raise SettingsError(problem)
    return settings


SECRET_FIELDS = frozenset({"api_keys"})  # never logged: shown as "<N hidden>"


def settings_as_dict(settings: Any) -> dict[str, Any]:
    """Plain dict for logging (secrets in URLs and secret fields are masked)."""
    out = dataclasses.asdict(settings)
    for key, value in out.items():
        if key in SECRET_FIELDS:
            out[key] = f"<{len(value)} hidden>"
            continue
        if isinstance(value, str) and "://" in value and "@" in value:
            scheme, rest = value.split("://", 1)
            out[key] = f"{scheme}://***@{rest.split('@', 1)[1]}"
    return out
