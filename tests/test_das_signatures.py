"""das/ functions take at most 12 parameters: kernels get their state as tuples built in one place
(:class:`das.mix_kernels.MixModel`, :class:`~das.mix_kernels.Pending`, :class:`~das.mix_kernels.Scopes`, the walk's
:func:`das.trie_kernels.walk_views` and :func:`~das.trie_kernels.walk_settings`, ...), the drafter its settings as one
:class:`das.config.DASConfig` or mapping plus keyword overrides."""

from __future__ import annotations

import ast
from pathlib import Path

MAX_PARAMS = 12
DAS = Path(__file__).resolve().parent.parent / "das"


def parameter_counts() -> dict[str, int]:
    """``module.function`` -> its parameters (``self`` and ``cls`` not counted; ``*args`` and
    ``**kwargs`` one each), for every function defined in das/, kernels included."""
    out = {}
    for path in sorted(DAS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
                if a.args and a.args[0].arg in ("self", "cls"):
                    n -= 1
                out[f"{path.stem}.{node.name}"] = max(n, out.get(f"{path.stem}.{node.name}", 0))
    return out


def test_no_function_in_das_takes_more_than_twelve_parameters():
    counts = parameter_counts()
    assert {"mix_kernels.mix_batch", "trie_kernels.greedy_walk", "trie_kernels.draft_batch_parallel", "drafter.__init__"} <= set(counts)
    over = {name: n for name, n in counts.items() if n > MAX_PARAMS}
    assert not over, f"more than {MAX_PARAMS} parameters: {over}"


def test_the_kernels_py_func_signatures_agree_with_the_source():
    """The counts are those numba compiles: a kernel's ``py_func`` has the source's parameters."""
    import inspect

    from das import mix_kernels, step_threads, trie_kernels

    counts = parameter_counts()
    for name, f in (("mix_kernels.mix_batch", mix_kernels.mix_batch), ("mix_kernels._mix", mix_kernels._mix),
                    ("step_threads.insert_batch_parallel", step_threads.insert_batch_parallel),
                    ("mix_kernels.learn_rows", mix_kernels.learn_rows), ("trie_kernels.greedy_walk", trie_kernels.greedy_walk),
                    ("trie_kernels._best_walk", trie_kernels._best_walk), ("trie_kernels._draft_rows", trie_kernels._draft_rows),
                    ("trie_kernels.draft_batch_parallel", trie_kernels.draft_batch_parallel)):
        assert len(inspect.signature(f.py_func).parameters) == counts[name] <= MAX_PARAMS, name
