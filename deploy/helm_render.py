"""Render the CoSine Helm chart without Helm: ``python -m deploy.helm_render k8s [-f values.yaml] ...``

The chart in ``k8s/`` is a plain Helm chart (``helm template`` / ``helm install`` work as usual).
This module implements the subset of Go templates and Helm/Sprig functions the chart uses, so the
chart can be rendered and its objects validated where Helm is not installed (the tests do this).

Supported subset (keep the chart inside it; an unsupported construct is an error, never a silent
difference from Helm):

- text with ``{{ }}`` actions, ``{{-`` / ``-}}`` whitespace trimming, ``{{/* comments */}}``;
- ``if`` / ``else if`` / ``else`` / ``end``, ``range`` (lists, and maps in sorted key order, with
  ``$v :=`` or ``$k, $v :=``), ``with`` / ``else``, ``define`` (in ``_*.tpl`` files) and ``template``;
- pipelines ``a | f b``, parenthesised pipelines, variables ``$x :=`` / ``$x =`` / ``$`` / ``$x.Field``,
  fields ``.A.B`` on maps, literals (strings, raw strings, numbers, ``true``, ``false``, ``nil``);
- built-in objects ``.Values``, ``.Release`` (Name, Namespace, Service, IsInstall, IsUpgrade, Revision),
  ``.Chart`` (the Chart.yaml keys, capitalised: Name, Version, AppVersion, ...);
- functions: include, template, toYaml, indent, nindent, quote, squote, default, required, fail,
  printf (%s %d %v %q), print, add, sub, mul, div, max, eq, ne, lt, le, gt, ge, and, or, not, empty, hasKey, dict, list,
  int, toString, lower, upper, trunc, trimSuffix, trimPrefix, replace, contains, join, len, index,
  b64enc, coalesce, ternary, kindIs.

Values are merged as Helm does: the chart's values.yaml, then each ``-f`` file (maps merge
recursively, anything else replaces, ``null`` removes a key), then ``--set key.path=value``.
Missing map keys read as nil and print as an empty string, as in Helm.
"""

from __future__ import annotations

import argparse
import base64
import copy
import json
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class TemplateError(Exception):
    """A template cannot be parsed or rendered (the message names the template)."""


# ---- lexing ----------------------------------------------------------------------------------

_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)
_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<raw>`[^`]*`)
  | (?P<number>-?\d+(?:\.\d+)?)
  | (?P<declare>:=)
  | (?P<assign>=)
  | (?P<pipe>\|)
  | (?P<lparen>\()
  | (?P<rparen>\))
  | (?P<comma>,)
  | (?P<var>\$[A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)
  | (?P<field>(?:\.[A-Za-z_][A-Za-z0-9_]*)+|\.)
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
    """,
    re.X,
)


@dataclass
class Tok:
    kind: str
    text: str
    spaced: bool = False  # whitespace before it: "(x).F" chains a field, "(x) .F" is an argument


def lex_action(src: str, where: str) -> list[Tok]:
    out, pos, spaced = [], 0, False
    while pos < len(src):
        m = _TOKEN.match(src, pos)
        if not m:
            raise TemplateError(f"{where}: cannot read {src[pos:pos + 20]!r} in action {{{{{src}}}}}")
        pos = m.end()
        if m.lastgroup == "ws":
            spaced = True
        else:
            out.append(Tok(m.lastgroup, m.group(), spaced))
            spaced = False
    return out


# ---- parse tree ------------------------------------------------------------------------------


@dataclass
class Operand:
    kind: str  # literal | field | var | ident | pipe
    value: Any
    fields: tuple[str, ...] = ()


@dataclass
class Pipeline:
    decl: tuple[str, ...] = ()
    assign: bool = False  # "=" rather than ":="
    commands: list[list[Operand]] = field(default_factory=list)


@dataclass
class Text:
    text: str


@dataclass
class Action:
    pipe: Pipeline


@dataclass
class If:
    branches: list[tuple[Pipeline, list]]
    otherwise: list


@dataclass
class Range:
    pipe: Pipeline
    body: list
    otherwise: list


@dataclass
class With:
    pipe: Pipeline
    body: list
    otherwise: list


@dataclass
class TemplateCall:
    name: str
    pipe: Pipeline | None


class _Parser:
    def __init__(self, text: str, name: str, defines: dict[str, list]):
        self.name = name
        self.defines = defines
        self.items = self._split(text)
        self.pos = 0

    def _split(self, text: str) -> list:
        items: list = []
        pos = 0
        trim_next = False
        for m in _ACTION.finditer(text):
            chunk = text[pos:m.start()]
            if trim_next:
                chunk = chunk.lstrip()
            if m.group(1):
                chunk = chunk.rstrip()
            if chunk:
                items.append(Text(chunk))
            body = m.group(2).strip()
            trim_next = bool(m.group(3))
            pos = m.end()
            if body.startswith("/*"):
                if not body.endswith("*/"):
                    raise TemplateError(f"{self.name}: unterminated comment")
                continue
            line = text.count("\n", 0, m.start()) + 1
            items.append(lex_action(body, f"{self.name}:{line}"))
        chunk = text[pos:]
        if trim_next:
            chunk = chunk.lstrip()
        if chunk:
            items.append(Text(chunk))
        return items

    def parse(self) -> list:
        body, stop = self._body(("end", "else"))
        if stop is not None:
            raise TemplateError(f"{self.name}: unexpected {{{{{stop[0].text}}}}}")
        return body

    def _body(self, stops: tuple[str, ...]) -> tuple[list, list[Tok] | None]:
        nodes: list = []
        while self.pos < len(self.items):
            item = self.items[self.pos]
            self.pos += 1
            if isinstance(item, Text):
                nodes.append(item)
                continue
            if not item:
                raise TemplateError(f"{self.name}: empty action")
            head = item[0].text if item[0].kind == "ident" else None
            if head in stops:
                return nodes, item
            if head == "if":
                nodes.append(self._if(item[1:]))
            elif head == "range":
                pipe = self._pipeline(item[1:], allow_pair=True)
                body, stop = self._body(("end", "else"))
                otherwise = self._else_body(stop, "range")
                nodes.append(Range(pipe, body, otherwise))
            elif head == "with":
                pipe = self._pipeline(item[1:])
                body, stop = self._body(("end", "else"))
                otherwise = self._else_body(stop, "with")
                nodes.append(With(pipe, body, otherwise))
            elif head == "define":
                if len(item) != 2 or item[1].kind not in ("string", "raw"):
                    raise TemplateError(f"{self.name}: define needs one quoted name")
                body, stop = self._body(("end",))
                if stop is None:
                    raise TemplateError(f"{self.name}: define without end")
                self.defines[_string(item[1])] = body
            elif head == "template":
                if len(item) < 2 or item[1].kind not in ("string", "raw"):
                    raise TemplateError(f"{self.name}: template needs a quoted name")
                pipe = self._pipeline(item[2:]) if len(item) > 2 else None
                nodes.append(TemplateCall(_string(item[1]), pipe))
            elif head in ("end", "else", "block", "break", "continue"):
                raise TemplateError(f"{self.name}: unexpected or unsupported {{{{{head}}}}}")
            else:
                nodes.append(Action(self._pipeline(item)))
        return nodes, None

    def _else_body(self, stop: list[Tok] | None, what: str) -> list:
        if stop is None:
            raise TemplateError(f"{self.name}: {what} without end")
        if stop[0].text == "end":
            return []
        if len(stop) > 1:
            raise TemplateError(f"{self.name}: else {stop[1].text} is not supported after {what}")
        body, stop = self._body(("end",))
        if stop is None:
            raise TemplateError(f"{self.name}: {what} without end")
        return body

    def _if(self, cond: list[Tok]) -> If:
        branches = []
        otherwise: list = []
        pipe = self._pipeline(cond)
        while True:
            body, stop = self._body(("end", "else"))
            branches.append((pipe, body))
            if stop is None:
                raise TemplateError(f"{self.name}: if without end")
            if stop[0].text == "end":
                break
            if len(stop) > 1 and stop[1].text == "if":
                pipe = self._pipeline(stop[2:])
                continue
            if len(stop) > 1:
                raise TemplateError(f"{self.name}: else {stop[1].text} is not supported")
            otherwise, stop = self._body(("end",))
            if stop is None:
                raise TemplateError(f"{self.name}: if without end")
            break
        return If(branches, otherwise)

    # pipelines
    def _pipeline(self, toks: list[Tok], allow_pair: bool = False) -> Pipeline:
        pipe = Pipeline()
        kinds = [t.kind for t in toks]
        if len(toks) >= 2 and toks[0].kind == "var" and kinds[1] in ("declare", "assign"):
            pipe.decl, pipe.assign, toks = (toks[0].text,), kinds[1] == "assign", toks[2:]
        elif allow_pair and len(toks) >= 4 and kinds[:4] == ["var", "comma", "var", "declare"]:
            pipe.decl, toks = (toks[0].text, toks[2].text), toks[4:]
        pipe.commands, rest = self._commands(toks, 0)
        if rest != len(toks):
            raise TemplateError(f"{self.name}: unbalanced ')'")
        if not pipe.commands:
            raise TemplateError(f"{self.name}: missing value")
        return pipe

    def _commands(self, toks: list[Tok], i: int) -> tuple[list[list[Operand]], int]:
        commands: list[list[Operand]] = [[]]
        while i < len(toks):
            t = toks[i]
            if t.kind == "rparen":
                break
            if t.kind == "pipe":
                if not commands[-1]:
                    raise TemplateError(f"{self.name}: empty command before '|'")
                commands.append([])
                i += 1
                continue
            if t.kind == "lparen":
                inner, j = self._commands(toks, i + 1)
                if j >= len(toks) or toks[j].kind != "rparen":
                    raise TemplateError(f"{self.name}: unclosed '('")
                i = j + 1
                fields: tuple[str, ...] = ()
                if i < len(toks) and toks[i].kind == "field" and toks[i].text != "." and not toks[i].spaced:
                    fields = tuple(toks[i].text.split(".")[1:])
                    i += 1
                commands[-1].append(Operand("pipe", Pipeline(commands=inner), fields))
                continue
            commands[-1].append(self._operand(t))
            i += 1
        if commands == [[]]:
            return [], i
        if not commands[-1]:
            raise TemplateError(f"{self.name}: empty command after '|'")
        return commands, i

    def _operand(self, t: Tok) -> Operand:
        if t.kind in ("string", "raw"):
            return Operand("literal", _string(t))
        if t.kind == "number":
            return Operand("literal", float(t.text) if "." in t.text else int(t.text))
        if t.kind == "field":
            return Operand("field", None, tuple(t.text.split(".")[1:]) if t.text != "." else ())
        if t.kind == "var":
            name, *fields = t.text.split(".")
            return Operand("var", name, tuple(fields))
        if t.kind == "ident":
            if t.text in ("true", "false"):
                return Operand("literal", t.text == "true")
            if t.text == "nil":
                return Operand("literal", None)
            return Operand("ident", t.text)
        raise TemplateError(f"{self.name}: unexpected {t.text!r}")


def _string(t: Tok) -> str:
    if t.kind == "raw":
        return t.text[1:-1]
    return json.loads(t.text)


# ---- values and printing ---------------------------------------------------------------------


def truthy(v: Any) -> bool:
    if v is None or v is False:
        return False
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v != 0
    if isinstance(v, (str, list, tuple, dict)):
        return len(v) > 0
    return True


def go_str(v: Any) -> str:
    """What ``{{ v }}`` prints (Go's %v for the types values hold)."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v.is_integer() and abs(v) < 1e21:
            return str(int(v)) if abs(v) < 1e6 else f"{v:g}".replace("e+0", "e+0")
        return repr(v)
    if isinstance(v, str):
        return v
    raise TemplateError(f"refusing to print a {type(v).__name__} ({v!r:.60}): use toYaml")


def to_yaml(v: Any) -> str:
    if v is None:
        return "null"
    return yaml.safe_dump(v, default_flow_style=False, sort_keys=True, allow_unicode=True, width=1 << 16).rstrip("\n").removesuffix("\n...")


def _printf(fmt: str, *args: Any) -> str:
    it = iter(args)

    def sub(m: re.Match) -> str:
        verb = m.group(1)
        if verb == "%":
            return "%"
        try:
            a = next(it)
        except StopIteration:
            return f"%!{verb}(MISSING)"
        if verb == "d":
            return str(int(a))
        if verb == "q":
            return json.dumps(go_str(a))
        return go_str(a)

    return re.sub(r"%([sdvq%])", sub, fmt)


def _required(msg: str, v: Any) -> Any:
    if v is None or v == "":
        raise TemplateError(msg)
    return v


def _fail(msg: str) -> Any:
    raise TemplateError(msg)


def _default(d: Any, *given: Any) -> Any:
    return given[0] if given and truthy(given[0]) else d


def _dict(*kv: Any) -> dict:
    if len(kv) % 2:
        raise TemplateError("dict needs an even number of arguments")
    return {str(kv[i]): kv[i + 1] for i in range(0, len(kv), 2)}


def _and(*args: Any) -> Any:
    for a in args:
        if not truthy(a):
            return a
    return args[-1]


def _or(*args: Any) -> Any:
    for a in args:
        if truthy(a):
            return a
    return args[-1]


def _index(c: Any, keys: Sequence[Any]) -> Any:
    for k in keys:
        if c is None:
            return None
        c = c[int(k)] if isinstance(c, (list, tuple)) else c.get(k)
    return c


def _kind(v: Any) -> str:
    if v is None:
        return "invalid"
    return {bool: "bool", int: "int", float: "float64", str: "string", list: "slice", dict: "map"}.get(type(v), type(v).__name__)


FUNCTIONS: dict[str, Any] = {
    "toYaml": to_yaml,
    "indent": lambda n, s: "\n".join(" " * int(n) + line for line in str(s).split("\n")),
    "nindent": lambda n, s: "\n" + "\n".join(" " * int(n) + line for line in str(s).split("\n")),
    "quote": lambda *a: " ".join(json.dumps(go_str(x)) for x in a if x is not None),
    "squote": lambda *a: " ".join("'" + go_str(x) + "'" for x in a if x is not None),
    "default": _default,
    "required": _required,
    "fail": _fail,
    "printf": _printf,
    "print": lambda *a: "".join(go_str(x) for x in a),
    "eq": lambda a, *b: any(a == x for x in b),
    "ne": lambda a, b: a != b,
    "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b,
    "and": _and,
    "or": _or,
    "not": lambda a: not truthy(a),
    "empty": lambda a: not truthy(a),
    "hasKey": lambda d, k: isinstance(d, dict) and k in d,
    "dict": _dict,
    "list": lambda *a: list(a),
    "int": lambda a: int(float(a)) if a not in (None, "") else 0,
    "toString": go_str,
    "lower": lambda s: go_str(s).lower(),
    "upper": lambda s: go_str(s).upper(),
    "trunc": lambda n, s: go_str(s)[: int(n)] if int(n) >= 0 else go_str(s)[int(n):],
    "trimSuffix": lambda suf, s: go_str(s).removesuffix(suf),
    "trimPrefix": lambda pre, s: go_str(s).removeprefix(pre),
    "replace": lambda old, new, s: go_str(s).replace(old, new),
    "contains": lambda sub, s: sub in go_str(s),
    "join": lambda sep, items: sep.join(go_str(x) for x in (items or [])),
    "len": lambda a: len(a) if a is not None else 0,
    "add": lambda *a: sum(int(x) for x in a),
    "sub": lambda a, b: int(a) - int(b),
    "mul": lambda a, b: int(a) * int(b),
    "div": lambda a, b: int(a) // int(b),
    "max": lambda *a: max(int(x) for x in a),
    "index": lambda c, *keys: _index(c, keys),
    "b64enc": lambda s: base64.b64encode(go_str(s).encode()).decode(),
    "coalesce": lambda *a: next((x for x in a if truthy(x)), None),
    "ternary": lambda t, f, c: t if truthy(c) else f,
    "kindIs": lambda k, v: _kind(v) == k,
}


# ---- evaluation ------------------------------------------------------------------------------


class _Scope:
    def __init__(self, parent: _Scope | None = None, **values: Any):
        self.parent = parent
        self.values = dict(values)

    def get(self, name: str) -> Any:
        scope: _Scope | None = self
        while scope is not None:
            if name in scope.values:
                return scope.values[name]
            scope = scope.parent
        raise TemplateError(f"undefined variable {name}")

    def set(self, name: str, value: Any) -> None:
        scope: _Scope | None = self
        while scope is not None:
            if name in scope.values:
                scope.values[name] = value
                return
            scope = scope.parent
        raise TemplateError(f"assignment to undeclared variable {name}")


class Engine:
    """Renders templates that share one set of ``define``d partials."""

    def __init__(self, templates: Mapping[str, str]):
        self.defines: dict[str, list] = {}
        self.trees: dict[str, list] = {}
        for name, text in templates.items():
            self.trees[name] = _Parser(text, name, self.defines).parse()
        self.depth = 0

    def render(self, name: str, dot: Any) -> str:
        out: list[str] = []
        try:
            self._nodes(self.trees[name], dot, _Scope(None, **{"$": dot}), out)
        except TemplateError as exc:
            if str(exc).startswith(name + ":"):
                raise
            raise TemplateError(f"{name}: {exc}") from None
        return "".join(out)

    def include(self, name: str, dot: Any) -> str:
        if name not in self.defines:
            raise TemplateError(f"no template {name!r} defined")
        self.depth += 1
        if self.depth > 100:
            raise TemplateError("include nested too deep")
        try:
            out: list[str] = []
            self._nodes(self.defines[name], dot, _Scope(None, **{"$": dot}), out)
            return "".join(out)
        finally:
            self.depth -= 1

    def _nodes(self, nodes: list, dot: Any, scope: _Scope, out: list[str]) -> None:
        for node in nodes:
            if isinstance(node, Text):
                out.append(node.text)
            elif isinstance(node, Action):
                value = self._pipe(node.pipe, dot, scope)
                if not node.pipe.decl:
                    out.append(go_str(value))
            elif isinstance(node, If):
                for cond, body in node.branches:
                    if truthy(self._pipe(cond, dot, scope)):
                        self._nodes(body, dot, _Scope(scope), out)
                        break
                else:
                    self._nodes(node.otherwise, dot, _Scope(scope), out)
            elif isinstance(node, Range):
                self._range(node, dot, scope, out)
            elif isinstance(node, With):
                value = self._pipe(node.pipe, dot, scope)
                if truthy(value):
                    self._nodes(node.body, value, _Scope(scope), out)
                else:
                    self._nodes(node.otherwise, dot, _Scope(scope), out)
            elif isinstance(node, TemplateCall):
                data = self._pipe(node.pipe, dot, scope) if node.pipe else None
                out.append(self.include(node.name, data))
            else:  # pragma: no cover
                raise TemplateError(f"unknown node {node!r}")

    def _range(self, node: Range, dot: Any, scope: _Scope, out: list[str]) -> None:
        pipe = Pipeline(commands=node.pipe.commands)
        seq = self._pipe(pipe, dot, scope)
        if seq is None:
            items: list[tuple[Any, Any]] = []
        elif isinstance(seq, dict):
            items = [(k, seq[k]) for k in sorted(seq)]
        elif isinstance(seq, (list, tuple)):
            items = list(enumerate(seq))
        elif isinstance(seq, int) and not isinstance(seq, bool):
            items = [(i, i) for i in range(seq)]
        else:
            raise TemplateError(f"range over a {type(seq).__name__}")
        if not items:
            self._nodes(node.otherwise, dot, _Scope(scope), out)
            return
        for key, value in items:
            inner = _Scope(scope)
            if len(node.pipe.decl) == 1:
                inner.values[node.pipe.decl[0]] = value
            elif len(node.pipe.decl) == 2:
                inner.values[node.pipe.decl[0]] = key
                inner.values[node.pipe.decl[1]] = value
            self._nodes(node.body, value, inner, out)

    def _pipe(self, pipe: Pipeline, dot: Any, scope: _Scope) -> Any:
        value: Any = _NOTHING
        for cmd in pipe.commands:
            value = self._command(cmd, dot, scope, value)
        if pipe.decl:
            if pipe.assign:
                scope.set(pipe.decl[0], value)
            else:
                scope.values[pipe.decl[0]] = value
        return value

    def _command(self, cmd: list[Operand], dot: Any, scope: _Scope, piped: Any) -> Any:
        first = cmd[0]
        if first.kind == "ident":
            args = [self._operand(op, dot, scope) for op in cmd[1:]]
            if piped is not _NOTHING:
                args.append(piped)
            return self._call(first.value, args)
        if len(cmd) > 1 or piped is not _NOTHING:
            raise TemplateError("only functions take arguments")
        return self._operand(first, dot, scope)

    def _call(self, name: str, args: list[Any]) -> Any:
        if name in ("include", "template"):
            if len(args) != 2:
                raise TemplateError(f"{name} takes a name and a value")
            return self.include(args[0], args[1])
        fn = FUNCTIONS.get(name)
        if fn is None:
            raise TemplateError(f"function {name!r} is not in the supported subset")
        try:
            return fn(*args)
        except TemplateError:
            raise
        except (TypeError, ValueError) as exc:
            raise TemplateError(f"{name}: {exc}") from None

    def _operand(self, op: Operand, dot: Any, scope: _Scope) -> Any:
        if op.kind == "literal":
            return op.value
        if op.kind == "ident":
            return self._call(op.value, [])
        if op.kind == "field":
            base = dot
        elif op.kind == "var":
            base = scope.get(op.value)
        else:  # pipe
            base = self._pipe(op.value, dot, scope)
        for i, name in enumerate(op.fields):
            if base is None:
                raise TemplateError(f"nil pointer evaluating .{'.'.join(op.fields[:i + 1])}")
            if not isinstance(base, dict):
                raise TemplateError(f"can't evaluate field {name} in a {type(base).__name__}")
            base = base.get(name)
        return base


_NOTHING = object()


# ---- charts ----------------------------------------------------------------------------------


def merge_values(base: Any, override: Any) -> Any:
    """Helm's coalescing: maps merge recursively, a null removes the key, anything else replaces."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = merge_values(base.get(k), v)
        return out
    return copy.deepcopy(override)


def parse_set(expr: str) -> dict:
    """``a.b.c=value`` -> {"a": {"b": {"c": value}}} (value parsed as YAML scalar)."""
    key, sep, raw = expr.partition("=")
    if not sep or not key:
        raise TemplateError(f"--set {expr!r}: expected key=value")
    value = yaml.safe_load(raw) if raw else ""
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


@dataclass
class Chart:
    path: Path
    metadata: dict
    values: dict
    templates: dict[str, str]  # relative path (templates/x.yaml) -> text


def load_chart(path: str | Path) -> Chart:
    p = Path(path)
    metadata = yaml.safe_load((p / "Chart.yaml").read_text())
    if not isinstance(metadata, dict) or metadata.get("apiVersion") != "v2":
        raise TemplateError(f"{p / 'Chart.yaml'}: expected apiVersion v2")
    values = yaml.safe_load((p / "values.yaml").read_text()) or {}
    templates = {
        str(f.relative_to(p)): f.read_text()
        for f in sorted((p / "templates").rglob("*"))
        if f.is_file() and (f.suffix in (".yaml", ".yml", ".tpl") or f.name == "NOTES.txt")
    }
    return Chart(p, metadata, values, templates)


def render_chart(
    chart: str | Path | Chart,
    values_files: Sequence[str | Path] = (),
    set_values: Sequence[str] = (),
    release_name: str = "cosine",
    namespace: str = "default",
) -> dict[str, str]:
    """Render every template as ``helm template`` would: relative path -> text (partials omitted)."""
    ch = chart if isinstance(chart, Chart) else load_chart(chart)
    values = copy.deepcopy(ch.values)
    for f in values_files:
        values = merge_values(values, yaml.safe_load(Path(f).read_text()) or {})
    for expr in set_values:
        values = merge_values(values, parse_set(expr))
    root = {
        "Values": values,
        "Release": {"Name": release_name, "Namespace": namespace, "Service": "Helm", "IsInstall": True, "IsUpgrade": False, "Revision": 1},
        "Chart": {k[:1].upper() + k[1:]: v for k, v in ch.metadata.items()},
        "Capabilities": {},
        "Files": {},
    }
    engine = Engine(ch.templates)
    return {name: engine.render(name, root) for name in ch.templates if not Path(name).name.startswith("_")}


def render_objects(chart: str | Path | Chart, values_files: Sequence[str | Path] = (), **kwargs: Any) -> list[dict]:
    """The Kubernetes objects of the rendered chart (NOTES.txt and empty documents dropped)."""
    objects = []
    for name, text in render_chart(chart, values_files, **kwargs).items():
        if name.endswith("NOTES.txt"):
            continue
        try:
            docs = list(yaml.safe_load_all(text))
        except yaml.YAMLError as exc:
            raise TemplateError(f"{name}: rendered text is not YAML: {exc}") from None
        for doc in docs:
            if doc is None:
                continue
            if not isinstance(doc, dict) or "kind" not in doc:
                raise TemplateError(f"{name}: a rendered document is not a Kubernetes object")
            objects.append(doc)
    return objects


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.helm_render", description="Render a Helm chart without Helm (the subset the CoSine chart uses).")
    parser.add_argument("chart", help="chart directory (e.g. k8s)")
    parser.add_argument("-f", "--values", action="append", default=[], help="values file (repeatable, later wins)")
    parser.add_argument("--set", action="append", default=[], dest="set_values", metavar="KEY=VALUE", help="set one value (repeatable)")
    parser.add_argument("--name", default="cosine", help="release name")
    parser.add_argument("-n", "--namespace", default="default")
    args = parser.parse_args(argv)
    try:
        rendered = render_chart(args.chart, args.values, args.set_values, args.name, args.namespace)
    except (TemplateError, OSError, yaml.YAMLError) as exc:
        print(f"helm_render: error: {exc}", file=sys.stderr)
        return 1
    for name, text in rendered.items():
        if name.endswith("NOTES.txt") or not text.strip():
            continue
        sys.stdout.write(f"---\n# Source: {Path(args.chart).name}/{name}\n{text.strip()}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
