"""Render and lint the Helm chart in k8s/ with Helm itself (Helm v4's Go SDK, bundled in the
``helm-python-sdk`` wheel: no helm binary, no cluster, works offline).

    python -m deploy.helm_chart k8s -f k8s/examples/values-multi-drafter.yaml --set redis.enabled=false

prints the rendered manifests, as ``helm template`` would. Tests use :func:`render_objects` (the
Kubernetes objects) and :func:`lint` (``helm lint --strict``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml


class ChartError(RuntimeError):
    """The chart cannot be loaded or rendered with these values; the message says why."""


def parse_set(assignments: Sequence[str]) -> dict[str, Any]:
    """``--set`` values (``a.b=c``) as nested values; the right side is a YAML scalar, as Helm reads it."""
    out: dict[str, Any] = {}
    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ChartError(f"--set {item!r}: expected KEY=VALUE")
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ChartError(f"--set {item!r}: {part} is not a map")
        node[leaf] = yaml.safe_load(raw) if raw else ""
    return out


def merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge of values maps, ``override`` winning (Helm's precedence for -f files and --set)."""
    out = dict(base)
    for key, value in override.items():
        out[key] = merge(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) else value
    return out


def user_values(values_files: Sequence[str | Path] = (), set_values: Sequence[str] = ()) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for f in values_files:
        values = merge(values, yaml.safe_load(Path(f).read_text()) or {})
    return merge(values, parse_set(set_values))


def render(
    chart: str | Path,
    values_files: Sequence[str | Path] = (),
    set_values: Sequence[str] = (),
    name: str = "cosine",
    namespace: str = "default",
) -> dict[str, str]:
    """Template path -> rendered text, rendered by Helm."""
    from helm_python import HelmError
    from helm_python.chart import Chart

    try:
        loaded = Chart.load(str(chart))
        return loaded.render(user_values(values_files, set_values), name=name, namespace=namespace, is_install=True)
    except HelmError as exc:
        raise ChartError(f"{chart}: {exc}") from None


def render_objects(
    chart: str | Path,
    values_files: Sequence[str | Path] = (),
    set_values: Sequence[str] = (),
    name: str = "cosine",
    namespace: str = "default",
) -> list[dict]:
    """The Kubernetes objects of the rendered chart (NOTES.txt and empty documents dropped)."""
    objects = []
    for path, text in sorted(render(chart, values_files, set_values, name, namespace).items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc is None:
                continue
            if not isinstance(doc, dict) or "kind" not in doc:
                raise ChartError(f"{path}: a rendered document is not a Kubernetes object")
            objects.append(doc)
    return objects


def lint(chart: str | Path, values_files: Sequence[str | Path] = (), set_values: Sequence[str] = ()) -> dict[str, Any]:
    """``helm lint --strict``: ``{"messages": [{"severity", "path", "error"}], "errors": [...]}``
    (severity 1 info, 2 warning, 3 error)."""
    from helm_python import chart as helm_chart

    return helm_chart.lint(str(chart), user_values(values_files, set_values), strict=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.helm_chart",
        description="Render a Helm chart with Helm's own library (like `helm template`).",
    )
    parser.add_argument("chart", help="chart directory (e.g. k8s)")
    parser.add_argument("-f", "--values", action="append", default=[], help="values file (repeatable, later wins)")
    parser.add_argument(
        "--set", action="append", default=[], dest="set_values", metavar="KEY=VALUE", help="set one value (repeatable)"
    )
    parser.add_argument("--name", default="cosine", help="release name")
    parser.add_argument("-n", "--namespace", default="default")
    args = parser.parse_args(argv)
    try:
        rendered = render(args.chart, args.values, args.set_values, args.name, args.namespace)
    except (ChartError, OSError, yaml.YAMLError) as exc:
        print(f"helm_chart: error: {exc}", file=sys.stderr)
        return 1
    for path, text in sorted(rendered.items()):
        if text.strip() and not path.endswith("NOTES.txt"):
            print(f"---\n# Source: {path}\n{text.strip()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
