"""``sharding/`` is a library on its own: it never imports ``recsys`` and its modules import each
other without a cycle (not even one hidden by an import inside a function)."""

from __future__ import annotations

import ast
from pathlib import Path
from tests.support.processes import fresh_python

ROOT = Path(__file__).resolve().parents[3]
# every module, by its dotted name under sharding (packages' __init__ included: "planner.cost")
MODULES = sorted(
    ".".join(
        p.relative_to(ROOT / "sharding").with_suffix("").parts[:-1]
        if p.stem == "__init__"
        else p.relative_to(ROOT / "sharding").with_suffix("").parts
    )
    for p in (ROOT / "sharding").rglob("*.py")
    if p.relative_to(ROOT / "sharding").parts != ("__init__.py",)
)


def _path(m: str) -> Path:
    base = ROOT / "sharding" / m.replace(".", "/")
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def test_importing_every_sharding_module_loads_no_recsys_module():
    code = (
        "import importlib, sys\n"
        f"for m in {MODULES!r}:\n"
        "    importlib.import_module('sharding.' + m)\n"
        "bad = sorted(m for m in sys.modules if m == 'recsys' or m.startswith('recsys.'))\n"
        "print('LOADED', len([m for m in sys.modules if m.startswith('sharding.')]), bad)\n"
    )
    out = fresh_python(code, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line == f"LOADED {len(MODULES)} []", line


def _sharding_imports(path: Path) -> set[str]:
    """Every ``sharding.X`` module that ``path`` imports, at any depth of the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sharding."):
            base = node.module.removeprefix("sharding.")
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES)
        elif isinstance(node, ast.ImportFrom) and node.module == "sharding":
            out.update(a.name for a in node.names if a.name in MODULES)
        elif isinstance(node, ast.Import):
            out.update(a.name.removeprefix("sharding.") for a in node.names if a.name.startswith("sharding."))
    return out


def test_no_recsys_import_and_no_cycle_in_the_source():
    graph = {}
    for m in MODULES:
        src = _path(m)
        tree = ast.parse(src.read_text())
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            )
            assert not any(n == "recsys" or n.startswith("recsys.") for n in names), (
                f"{src.relative_to(ROOT)} line {node.lineno} imports recsys"
            )
        graph[m] = _sharding_imports(src) - {m}
    # depth-first search for a back edge
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d) :] + [d]) if d in stack else d)
            if d in graph and not state.get(d):
                visit(d, stack + [d])
        state[m] = 2

    for m in MODULES:
        if not state.get(m):
            visit(m, [m])
