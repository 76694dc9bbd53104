"""The project's own modules import each other without a cycle (direct or through others).

The graph is built with ``ast`` over ``das/``, ``scheduler/``, ``integrations/`` and ``benchmarks/``:
every ``import`` and ``from ... import`` counts, at module level and inside functions alike (a
function-level import still ties the two modules together; it only defers the cycle to run time);
imports under ``if TYPE_CHECKING:`` do not (they never run).
``from pkg import name`` counts as an import of ``pkg.name`` when that is a module, else of ``pkg``;
importing a module also imports its packages' ``__init__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("das", "scheduler", "integrations", "benchmarks")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The longest prefix of dotted ``name`` that is one of the project's modules."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in mods:
            return cand
    return None


def _imports(tree: ast.AST):
    """Every import node of ``tree`` outside ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (module doc)."""
    mods = _modules()
    g: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                dest = _resolve(t, mods)
                if dest is None or dest == mod:
                    continue
                g[mod].add(dest)
                # importing a.b.c runs a/__init__ and a/b/__init__ first
                parts = dest.split(".")
                for n in range(1, len(parts)):
                    parent = ".".join(parts[:n])
                    if parent in mods and parent != mod and not mod.startswith(parent + "."):
                        g[mod].add(parent)
    return g


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``g`` with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in g:
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(g[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_cycles_finds_direct_and_indirect_cycles():
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_graph_sees_the_project():
    g = import_graph()
    assert "scheduler.budget_protocol" in g["scheduler.planner"]  # module level
    assert "scheduler.planner" in g["integrations.vllm_ext.proposer"]
    assert "integrations.rl.ab" in g["integrations.rl.grpo"]  # function level
    assert "das.problem_store" not in g["das.request_table"]  # under TYPE_CHECKING only


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, f"import cycles among the project's modules: {found}"
