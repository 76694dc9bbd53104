"""Rewards for RL rollouts: math answers checked with math-verify, code run against unit tests.

Math (:func:`math_reward`): the response's last ``\\boxed{...}`` is compared with the problem's
LaTeX ground truth by ``math_verify`` (``verify(parse(gold), parse(answer))``, so ``3/7``,
``\\frac{3}{7}`` and ``0.428571`` are the same answer). As DeepScaleR does, only a boxed answer
counts (``require_boxed``). A small *format reward* (``format_weight``, default 0.1) goes to a
wrong answer that at least has a non-empty ``\\boxed{}``, so a policy that solves nothing yet
still gets a signal to move on.

Code (:func:`code_reward`): the last fenced code block of the response is put between the
problem's prelude and its tests (:meth:`integrations.data.Problem.test_program`) and run by
:func:`run_program` in a *separate process*, never in the caller's process:

* a fresh ``python -I`` (isolated mode: no user site, no ``PYTHON*`` variables) in a new session
  and an empty temporary working directory, with stdin closed and a minimal environment;
* resource limits set inside the child before any of the untrusted code runs: address space
  (``memory_mb``), CPU seconds, file size (``max_file_mb``), open files, no core dumps. They are
  set by a small launcher at the top of the child rather than in ``preexec_fn``: the trainer
  process runs OpenMP and vLLM threads, and Python documents ``preexec_fn`` as unsafe there;
* a wall-clock ``timeout_s``: on expiry the child's whole process group is killed;
* no network: the child runs under ``unshare -n`` (a new, empty network namespace: root) or
  ``unshare -rn`` (an unprivileged user namespace), whichever works here (probed once, see
  :func:`network_isolation`). Where neither works, ``network="isolate"`` (default) runs the code
  with the network reachable and says so in :attr:`CodeResult.network_isolated` (and a warning);
  ``network="require"`` refuses to run instead.

A response passes when the program exits with status 0. Reward: 1.0 when the tests pass, else
``format_weight`` when the response holds a code block, else 0.

:func:`score_responses` scores a batch (code runs ``workers`` at a time) and returns
:class:`Reward` records; :func:`make_reward_fn` builds the ``(problem, response) -> Reward`` the
GRPO loop calls. :func:`overlong_penalty` (DAPO's soft overlong punishment) is added by the loop,
which knows the response lengths.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

__all__ = [
    "Reward",
    "CodeResult",
    "last_boxed",
    "extract_code",
    "math_reward",
    "code_reward",
    "run_program",
    "network_isolation",
    "score_responses",
    "make_reward_fn",
    "overlong_penalty",
]


@dataclasses.dataclass
class Reward:
    """One response's score.

    Attributes:
        score: the scalar the RL loss uses (correct: 1.0; else ``format_weight`` if well formed; else 0).
        correct: math answer verified / code tests passed.
        formatted: has a non-empty ``\\boxed{}`` (math) or a fenced code block (code).
        detail: short text on why (for logs), e.g. ``"no boxed answer"``, ``"timeout"``.
    """

    score: float
    correct: bool
    formatted: bool
    detail: str = ""


# ----------------------------------------------------------------------------------------------
# math


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced; None if absent."""
    best = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
            i += 1
        if depth == 0:
            best = text[m.end() : i - 1]
    return best


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str):
    from math_verify import parse

    return parse(f"${answer}$")


def math_reward(response: str, answer: str | None, *, format_weight: float = 0.1, require_boxed: bool = True) -> Reward:
    """Score a math ``response`` against the LaTeX ground truth ``answer``.

    Args:
        response: the model's text.
        answer: ground truth (LaTeX, e.g. ``"\\frac{3}{7}"``); None or empty scores 0.
        format_weight: reward of a wrong answer that has a non-empty ``\\boxed{}``.
        require_boxed: only a boxed answer counts (DeepScaleR's rule); False lets math-verify
            extract an answer from anywhere in the response when nothing is boxed.

    Call from the main thread: math-verify's own timeouts use ``signal.alarm``.
    """
    from math_verify import parse, verify

    boxed = last_boxed(response)
    formatted = bool(boxed and boxed.strip())
    if not answer or not str(answer).strip():
        return Reward(0.0, False, formatted, "no ground truth")
    if formatted:
        pred = parse(f"${boxed}$")
    elif require_boxed:
        return Reward(0.0, False, False, "no boxed answer")
    else:
        pred = parse(response)
    if not pred:
        return Reward(format_weight if formatted else 0.0, False, formatted, "unparsable answer")
    try:
        ok = bool(verify(_parse_gold(str(answer)), pred))
    except Exception as exc:  # math-verify raises on rare sympy failures
        return Reward(format_weight if formatted else 0.0, False, formatted, f"verify failed: {type(exc).__name__}")
    if ok:
        return Reward(1.0, True, formatted, "correct")
    return Reward(format_weight if formatted else 0.0, False, formatted, "wrong answer")


# ----------------------------------------------------------------------------------------------
# code

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.S)


def extract_code(response: str) -> str | None:
    """The last fenced code block of ``response`` (a ``python``/``py`` one preferred), or None.

    An unterminated final fence (a response cut by the token limit) counts up to the end.
    """
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(response)]
    if not blocks:
        m = re.search(r"```[ \t]*(?:python|py)?[^\n]*\n(.*)\Z", response, re.S)
        return m.group(1) if m and m.group(1).strip() else None
    py = [code for lang, code in blocks if lang in ("python", "python3", "py")]
    code = (py or [code for _, code in blocks])[-1]
    return code if code.strip() else None


@dataclasses.dataclass
class CodeResult:
    """Outcome of :func:`run_program`."""

    passed: bool
    returncode: int | None  # None when killed on timeout
    timed_out: bool
    seconds: float
    stderr_tail: str
    network_isolated: bool


# Runs first in the child: limits, then the untrusted program as __main__.
_LAUNCHER = r"""
import resource, sys
mem, cpu, fsize, nofile = (int(x) for x in sys.argv[1:5])
path = sys.argv[5]
for lim, v in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_DATA, mem)):
    if v > 0:
        resource.setrlimit(lim, (v, v))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
sys.argv = [path]
with open(path, encoding="utf-8") as f:
    src = f.read()
del resource, mem, cpu, fsize, nofile
exec(compile(src, path, "exec"), {"__name__": "__main__", "__file__": path})
"""

_NET_LOCK = threading.Lock()
_NET_PREFIX: list[str] | None = None
_NET_WARNED = False


def network_isolation() -> list[str] | None:
    """Command prefix that runs a program without network (``["unshare", "-n"]`` or ``["unshare", "-rn"]``).

    Probed once per process by running ``unshare ... true``; None when neither works here
    (then :func:`run_program` cannot cut the network).
    """
    global _NET_PREFIX
    with _NET_LOCK:
        if _NET_PREFIX is None:
            _NET_PREFIX = []
            exe = shutil.which("unshare")
            if exe and sys.platform.startswith("linux"):
                for flags in (["-n"], ["-rn"]):
                    try:
                        r = subprocess.run([exe, *flags, "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10)
                    except (OSError, subprocess.TimeoutExpired):
                        continue
                    if r.returncode == 0:
                        _NET_PREFIX = [exe, *flags]
                        break
        return list(_NET_PREFIX) or None


def run_program(
    program: str,
    *,
    timeout_s: float = 6.0,
    memory_mb: int = 1024,
    max_file_mb: int = 16,
    network: str = "isolate",
    python: str | None = None,
) -> CodeResult:
    """Run untrusted Python source in a sandboxed child process (see the module doc).

    Args:
        program: the whole program (e.g. ``problem.test_program(solution)``).
        timeout_s: wall-clock limit; the CPU limit is ``ceil(timeout_s) + 1`` seconds.
        memory_mb: address-space limit (0: none).
        max_file_mb: largest file the program may write.
        network: ``"isolate"`` (cut it when this machine allows, else run anyway and warn once),
            ``"require"`` (raise ``RuntimeError`` when it cannot be cut) or ``"allow"``.
        python: interpreter (default: this one, so the same site-packages, e.g. sortedcontainers).

    Returns:
        :class:`CodeResult`; ``passed`` iff the program exited with status 0 in time.
    """
    global _NET_WARNED
    if network not in ("isolate", "require", "allow"):
        raise ValueError(f"network must be 'isolate', 'require' or 'allow', got {network!r}")
    prefix = network_isolation() if network != "allow" else None
    if prefix is None and network == "require":
        raise RuntimeError("cannot cut the network for untrusted code here (no working 'unshare -n' / 'unshare -rn')")
    if prefix is None and network == "isolate" and not _NET_WARNED:
        _NET_WARNED = True
        warnings.warn("rewards: running untrusted code WITH network access (unshare -n / -rn do not work here)", RuntimeWarning, stacklevel=2)
    cpu = int(timeout_s) + 2
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="das-code-") as tmp:
        path = os.path.join(tmp, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(program)
        cmd = [*(prefix or []), python or sys.executable, "-I", "-c", _LAUNCHER,
               str(int(memory_mb) << 20), str(cpu), str(int(max_file_mb) << 20), "256", path]
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "PYTHONHASHSEED": "0", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
        timed_out = False
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, err = proc.communicate()
        rc = None if timed_out else proc.returncode
    tail = (err or b"")[-600:].decode("utf-8", "replace")
    return CodeResult(rc == 0, rc, timed_out, time.perf_counter() - t0, tail, prefix is not None)


def code_reward(response: str, problem: Any, *, format_weight: float = 0.1, **run_kwargs: Any) -> Reward:
    """Score a code ``response`` by running ``problem.test_program(code)`` sandboxed (see :func:`run_program`)."""
    code = extract_code(response)
    if code is None:
        return Reward(0.0, False, False, "no code block")
    res = run_program(problem.test_program(code), **run_kwargs)
    if res.passed:
        return Reward(1.0, True, True, "passed")
    why = "timeout" if res.timed_out else (res.stderr_tail.strip().splitlines() or ["failed"])[-1][:120]
    return Reward(format_weight, False, True, why)


# ----------------------------------------------------------------------------------------------
# batches


def score_responses(
    problems: Sequence[Any],
    responses: Sequence[str],
    *,
    format_weight: float = 0.1,
    require_boxed: bool = True,
    workers: int = 2,
    **run_kwargs: Any,
) -> list[Reward]:
    """Score ``responses[i]`` against ``problems[i]`` (an :class:`integrations.data.Problem`).

    Math is checked in this thread (math-verify needs the main thread for its timeouts); code
    runs in child processes, ``workers`` at a time. ``run_kwargs`` go to :func:`run_program`.
    """
    if len(problems) != len(responses):
        raise ValueError(f"got {len(problems)} problems for {len(responses)} responses")
    out: list[Reward | None] = [None] * len(responses)
    code_idx = [i for i, p in enumerate(problems) if p.kind == "code"]
    for i, p in enumerate(problems):
        if p.kind == "math":
            out[i] = math_reward(responses[i], p.answer, format_weight=format_weight, require_boxed=require_boxed)
    if code_idx:
        with ThreadPoolExecutor(max_workers=max(1, int(workers))) as pool:
            futs = {i: pool.submit(code_reward, responses[i], problems[i], format_weight=format_weight, **run_kwargs) for i in code_idx}
            for i, f in futs.items():
                out[i] = f.result()
    return [r for r in out if r is not None]


def overlong_penalty(length: int, max_tokens: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment: 0 up to ``max_tokens - buffer`` tokens, then falling linearly
    to ``-factor`` at ``max_tokens`` (and below, for longer). ``buffer <= 0`` disables it (0.0)."""
    if buffer <= 0 or length <= max_tokens - buffer:
        return 0.0
    return -float(factor) * (length - (max_tokens - buffer)) / float(buffer)


def make_reward_fn(**kwargs: Any) -> Callable[[Sequence[Any], Sequence[str]], list[Reward]]:
    """A batch reward function ``(problems, responses) -> list[Reward]`` with fixed settings."""
    return functools.partial(score_responses, **kwargs)
