"""The docs' commands are true: every das command in README.md, docs/*.md, recipes/README.md and benchmarks/README.md (shell code
blocks and inline code) is run once per entry point with ``--help``, every option a documented command uses
must appear in that help, and every results file the docs cite must exist.

One subprocess per distinct entry point (das-rollout, das-grpo, ``python -m benchmarks.X``, ...), not per
line; several import vLLM, so the module is ``slow`` (it still runs in README's ``pytest -q`` and in CI).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "recipes" / "README.md", REPO / "benchmarks" / "README.md"]
#: console scripts (pyproject.toml [project.scripts]) and the module each runs
SCRIPTS = {"das-rollout": "integrations.rollout", "das-grpo": "integrations.rl.grpo"}
#: packages of this project whose modules the docs run with ``python -m``
OWN = ("integrations", "benchmarks", "das", "scheduler")


def _code(path: Path) -> list[tuple[int, str]]:
    """(line number, shell text) of every shell code block (```bash, ```sh or unlabelled) and inline code span."""
    out: list[tuple[int, str]] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    block: list[str] | None = None
    start = 0
    for no, line in enumerate(lines, 1):
        fence = re.match(r"^\s*```(\w*)", line)
        if fence and block is None:
            block, start = ([] if fence.group(1) in ("", "bash", "sh", "shell", "console") else None), no
            if block is None:
                block = ["<skip>"]
            continue
        if fence and block is not None:
            if block[:1] != ["<skip>"]:
                out.append((start, "\n".join(block)))
            block = None
            continue
        if block is not None:
            block.append(line)
        else:
            out += [(no, span) for span in re.findall(r"`([^`]+)`", line)]
    return out


def _commands(text: str) -> list[list[str]]:
    """The simple commands of a shell text: continuations joined, comments dropped, split at ``&&``, ``||``, ``;``, ``|``
    and ``>``; environment assignments in front removed. Text that does not parse as shell is skipped."""
    text = text.replace("\\\n", " ")
    cmds: list[list[str]] = []
    for line in text.splitlines():
        try:
            lex = shlex.shlex(line, posix=True, punctuation_chars=True)
            lex.whitespace_split = True
            lex.commenters = "#"
            tokens = list(lex)
        except ValueError:
            continue
        cur: list[str] = []
        for tok in tokens + [";"]:
            if tok and set(tok) <= set("&|;<>()"):
                if cur:
                    cmds.append(cur)
                cur = []
                if ">" in tok or "<" in tok:
                    cur = ["<redirect>"]
                continue
            cur.append(tok)
    out = []
    for c in cmds:
        while c and re.match(r"^[A-Z_][A-Z0-9_]*=", c[0]):
            c = c[1:]
        if c and c[0] != "<redirect>":
            out.append(c)
    return out


def _entry(cmd: list[str]) -> tuple[str, list[str]] | None:
    """``(module, arguments)`` of a command that runs this project's code, else None."""
    prog = Path(cmd[0]).name
    if prog in SCRIPTS:
        return SCRIPTS[prog], cmd[1:]
    if re.fullmatch(r"python3?(\.\d+)?", prog) and len(cmd) >= 3 and cmd[1] == "-m":
        module = cmd[2]
        if module.split(".")[0] in OWN:
            return module, cmd[3:]
    return None


def _options(args: list[str]) -> list[str]:
    """The long options among ``args`` (``--x=1`` as ``--x``), up to a ``--`` separator."""
    out = []
    for a in args:
        if a == "--":
            break
        if a.startswith("--") and len(a) > 2:
            out.append(a.split("=", 1)[0])
    return out


def documented() -> dict[str, list[tuple[str, int, list[str]]]]:
    """``{module: [(doc file, line, arguments), ...]}`` for every documented command of this project."""
    found: dict[str, list[tuple[str, int, list[str]]]] = {}
    for doc in DOCS:
        for no, text in _code(doc):
            for cmd in _commands(text):
                hit = _entry(cmd)
                if hit is not None:
                    found.setdefault(hit[0], []).append((doc.relative_to(REPO).as_posix(), no, hit[1]))
    return found


def _help(module: str) -> tuple[int, str]:
    env = {**os.environ, "DAS_NO_REEXEC": "1", "VLLM_LOGGING_LEVEL": "ERROR", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    return r.returncode, r.stdout + r.stderr


def test_the_docs_name_the_main_commands():
    found = documented()
    for module in ("integrations.rollout", "integrations.rl.grpo", "integrations.data", "benchmarks.replay", "benchmarks.simulate"):
        assert module in found, f"no documented command runs {module}; the extraction is broken"
    assert any("--compare" in args for _, _, args in found["integrations.rollout"])


def test_every_documented_command_runs_with_help_and_knows_its_options():
    found = documented()
    with ThreadPoolExecutor(max_workers=4) as pool:
        helps = dict(zip(found, pool.map(_help, found)))
    bad = []
    for module, uses in sorted(found.items()):
        rc, text = helps[module]
        if rc != 0:
            bad.append(f"`python -m {module} --help` exited {rc}: {text.strip().splitlines()[-1:] if text.strip() else ''}")
            continue
        for doc, no, args in uses:
            for opt in _options(args):
                if not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", text):
                    bad.append(f"{doc}:{no}: {module} has no option {opt} (not in its --help)")
    assert not bad, "\n".join(bad)


def test_every_cited_results_file_exists():
    missing = []
    for doc in DOCS:
        for no, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for path in re.findall(r"benchmarks/results/[\w./-]*", line):
                path = path.rstrip(".")
                if not (REPO / path).exists():
                    missing.append(f"{doc.relative_to(REPO)}:{no}: {path}")
    assert not missing, "cited results files that do not exist:\n" + "\n".join(missing)


def test_the_extraction_reads_shell_as_the_docs_write_it():
    text = ("A=1 .venv/bin/das-rollout --data x \\\n    --json out.json   # comment --nope\n"
            "bash install.sh && .venv/bin/python -m benchmarks.step_phases -- das-rollout --prompts 2\n"
            "python -m integrations.config_doc > docs/configuration.md\n")
    cmds = [_entry(c) for c in _commands(text)]
    assert cmds == [("integrations.rollout", ["--data", "x", "--json", "out.json"]), None,
                    ("benchmarks.step_phases", ["--", "das-rollout", "--prompts", "2"]), ("integrations.config_doc", [])]
    assert _options(cmds[2][1]) == [] and _options(["--x=1", "-q", "--y"]) == ["--x", "--y"]
