"""The layers of the code base, read from its imports: each imports only the layers below it, and
no module reaches itself through the imports of others.

From the bottom: ``common.logs``; ``common.runtime`` (one model on one device) and ``common.spec``
(the speculative algorithms), which import neither the service platform nor a service;
``common.platform`` (settings, gRPC server, TLS, metrics, store), which imports no service; then
``services``, and the tools on top (the CLI, the zoo, the client SDK, the benchmarks). Every import
counts, also one inside a function or under ``TYPE_CHECKING``: a circle hidden there is still one.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "services", "cosine_cli", "cosine_client", "cosine_zoo", "benchmarks", "deploy")
# layer -> prefixes of modules it may never import
TOOLS = ("cosine_cli", "cosine_zoo", "benchmarks", "tests")  # on top: nothing below imports them
FORBIDDEN = {
    "common.runtime": ("common.platform", "services", "cosine_client", *TOOLS),
    "common.spec": ("common.platform", "services", "cosine_client", *TOOLS),
    "common.platform": ("common.runtime", "services", "cosine_client", *TOOLS),
    "common.logs": ("common.", "services", "cosine_client", *TOOLS),
    "services": TOOLS,
    "cosine_client": ("common.runtime", "common.spec", "services", *TOOLS),
    "cosine_zoo": ("services", "cosine_cli", "benchmarks", "tests"),
}


def production_modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if path.name.startswith("test_") or path.name == "conftest.py":
                continue
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


def imported(path: Path, module: str) -> Iterator[str]:
    """Every module name ``path`` imports, at any depth of its code."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)


def graph() -> dict[str, set[str]]:
    modules = production_modules()
    return {m: {i for i in imported(p, m) if i in modules and i != m} for m, p in modules.items()}


def within(module: str, prefix: str) -> bool:
    return module == prefix.rstrip(".") or module.startswith(prefix if prefix.endswith(".") else prefix + ".")


def test_every_layer_imports_only_the_layers_below_it():
    climbs = []
    for module, deps in graph().items():
        for layer, banned in FORBIDDEN.items():
            if within(module, layer):
                climbs += [f"{module} -> {d}" for d in sorted(deps) if any(within(d, b) for b in banned)]
    assert not climbs, "imports that climb a layer:\n" + "\n".join(climbs)


def test_no_module_imports_itself_through_others():
    g = graph()
    circles, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for d in sorted(g[m]):
            if state.get(d) == "open":
                circles.append(" -> ".join(path[path.index(d) :] + [m, d]) if d in path else f"{m} -> {d}")
            elif d not in state:
                visit(d, path + [m])
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m, [])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_graph_sees_the_imports_it_checks():
    """The checks above would pass on an empty graph: the engine must be seen importing the runner."""
    g = graph()
    assert "common.runtime.runner" in g["common.runtime.verifier_engine"]
    assert "common.platform.store" in g["services.corpus"]
