"""Rewards for RL rollouts: math answers checked with math-verify, code run against unit tests.

Math (:func:`math_reward`): the response's last ``\\boxed{...}`` is compared with the problem's
LaTeX ground truth by ``math_verify`` (``verify(parse(gold), parse(answer))``, so ``3/7``,
``\\frac{3}{7}`` and ``0.428571`` are the same answer). As DeepScaleR does, only a boxed answer
counts (``require_boxed``). A small *format reward* (``format_weight``, default 0.1) goes to a
wrong answer that at least has a non-empty ``\\boxed{}``, so a policy that solves nothing yet
still gets a signal to move on. Answer extraction is linear in the response and looks at its
last :data:`MAX_SCAN_CHARS` characters only. math-verify's own time limits use ``SIGALRM``,
which works on the main thread only: called from any other thread, the check runs in a helper
process (``python -m integrations.rl.rewards``: :func:`serve_math_checks`; started once, killed
and restarted when a check overruns :data:`MATH_TIMEOUT_S`).

Code (:func:`code_reward`): the last fenced code block of the response is run against the
problem's tests in the sandbox of :mod:`integrations.rl.code_sandbox` (:func:`run_tests`), whose
pass the code under test cannot forge. A code response's reward: 1.0 when the tests pass; 0 when
its code ends its own process (``os._exit``, ``sys.exit``) before the tests finish; else
``format_weight`` when the response holds a code block, else 0. :func:`run_program` runs a whole
program in the same sandbox; its ``passed`` is the program's own exit status 0, which the program
can fake, so rewards use :func:`run_tests`.

:func:`score_responses` scores a batch (code runs ``workers`` at a time; math in the calling
thread, any thread) and returns :class:`Reward` records; :func:`make_reward_fn` builds the
``(problems, responses) -> list[Reward]`` the GRPO loop calls. :func:`overlong_penalty` (DAPO's
soft overlong punishment) is added by the loop, which knows the response lengths.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import selectors
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from integrations.rl.code_sandbox import STDERR_CAP, CodeResult, SandboxUnavailable, check_sandbox, run_program, run_tests

__all__ = [
    "Reward",
    "CodeResult",
    "SandboxUnavailable",
    "MAX_SCAN_CHARS",
    "STDERR_CAP",
    "last_boxed",
    "extract_code",
    "math_reward",
    "code_reward",
    "run_program",
    "run_tests",
    "check_sandbox",
    "score_responses",
    "make_reward_fn",
    "overlong_penalty",
    "serve_math_checks",
]

#: Answer extraction (``last_boxed``, ``extract_code``) reads at most this many trailing characters.
MAX_SCAN_CHARS = 200_000
#: Hard limit of one math check in the helper process (math-verify's own limits are 5 s per step).
MATH_TIMEOUT_S = 30.0

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
# answer extraction (linear time, capped input)

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"[{}]")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced; None if absent.

    "Last" is the closed box that opens last (so ``\\boxed{\\boxed{1}}`` gives ``1``); a box whose
    braces never close does not count. One pass over the last :data:`MAX_SCAN_CHARS` characters.
    """
    if not isinstance(text, str):
        return None
    if len(text) > MAX_SCAN_CHARS:
        text = text[-MAX_SCAN_CHARS:]
    if "box" not in text:
        return None
    opens = {m.end() - 1 for m in _BOX_OPEN.finditer(text)}  # index of each box's "{"
    if not opens:
        return None
    stack: list[int] = []
    best = -1
    best_span = (0, 0)
    for m in _BRACE.finditer(text):
        i = m.start()
        if text[i] == "{":
            stack.append(i)
        elif stack:
            j = stack.pop()
            if j in opens and j > best:
                best, best_span = j, (j + 1, i)
    return text[best_span[0] : best_span[1]] if best >= 0 else None


_LANG = re.compile(r"[ \t]*([A-Za-z0-9_+-]*)")


def extract_code(response: str) -> str | None:
    """The last fenced code block of ``response`` (a ``python``/``py`` one preferred), or None.

    An unterminated final fence (a response cut by the token limit) counts up to the end when the
    response has no complete block. One pass over the last :data:`MAX_SCAN_CHARS` characters.
    """
    if not isinstance(response, str):
        return None
    text = response[-MAX_SCAN_CHARS:] if len(response) > MAX_SCAN_CHARS else response
    blocks: list[tuple[str, str]] = []
    unterminated: str | None = None
    pos = 0
    while True:
        i = text.find("```", pos)
        if i < 0:
            break
        nl = text.find("\n", i + 3)
        if nl < 0:
            break
        j = text.find("```", nl + 1)
        if j < 0:
            if not blocks:
                unterminated = text[nl + 1 :]
            break
        blocks.append((_LANG.match(text, i + 3, nl).group(1).lower(), text[nl + 1 : j]))
        pos = j + 3
    if not blocks:
        return unterminated if unterminated and unterminated.strip() else None
    py = [code for lang, code in blocks if lang in ("python", "python3", "py")]
    code = (py or [code for _, code in blocks])[-1]
    return code if code.strip() else None


# ----------------------------------------------------------------------------------------------
# math


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str):
    from math_verify import parse

    return parse(f"${answer}$")


def _math_check(target: str, boxed: bool, answer: str) -> str:
    """``"correct"``, ``"wrong answer"``, ``"unparsable answer"`` or ``"verify failed: ..."`` (main thread only)."""
    from math_verify import parse, verify

    pred = parse(f"${target}$" if boxed else target)
    if not pred:
        return "unparsable answer"
    try:
        ok = bool(verify(_parse_gold(answer), pred))
    except Exception as exc:  # math-verify raises on rare sympy failures
        return f"verify failed: {type(exc).__name__}"
    return "correct" if ok else "wrong answer"


def serve_math_checks() -> None:  # pragma: no cover - runs in the helper process
    """The math helper process's loop: one JSON request (``{"target", "boxed", "answer"}``) per
    stdin line, one JSON verdict per stdout line, until stdin closes."""
    out = sys.stdout
    sys.stdout = sys.stderr  # stray prints must not corrupt the protocol
    for line in sys.stdin:
        try:
            req = json.loads(line)
            verdict = _math_check(req["target"], bool(req["boxed"]), req["answer"])
        except Exception as exc:
            verdict = f"checker error: {type(exc).__name__}"
        out.write(json.dumps(verdict) + "\n")
        out.flush()


class _MathWorker:
    """A helper process that runs math-verify on its main thread (so its SIGALRM timeouts work)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        root = str(Path(__file__).resolve().parents[2])  # the directory above integrations/
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        env["OMP_NUM_THREADS"] = "1"
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        return subprocess.Popen([sys.executable, "-m", "integrations.rl.rewards"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, env=env, cwd=root, start_new_session=True)

    def _kill(self) -> None:
        if self._proc is not None:
            try:
                self._proc.kill()
                self._proc.wait(5)
            except Exception:
                pass
            self._proc = None

    def check(self, target: str, boxed: bool, answer: str, timeout_s: float = MATH_TIMEOUT_S) -> str:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            proc = self._proc
            try:
                proc.stdin.write((json.dumps({"target": target, "boxed": boxed, "answer": answer}) + "\n").encode())
                proc.stdin.flush()
            except OSError:
                self._kill()
                return "checker error: helper process died"
            sel = selectors.DefaultSelector()
            sel.register(proc.stdout, selectors.EVENT_READ)
            try:
                # The first request also waits for the helper to import math-verify (a few seconds).
                ready = sel.select(timeout_s + (20.0 if not getattr(proc, "_das_warm", False) else 0.0))
            finally:
                sel.close()
            if not ready:
                self._kill()
                return "timeout"
            line = proc.stdout.readline()
            if not line:
                self._kill()
                return "checker error: helper process died"
            proc._das_warm = True  # type: ignore[attr-defined]
            try:
                return str(json.loads(line))
            except ValueError:
                self._kill()
                return "checker error: bad reply"

    def close(self) -> None:
        with self._lock:
            self._kill()


_MATH_WORKER = _MathWorker()


def math_reward(response: str, answer: str | None, *, format_weight: float = 0.1, require_boxed: bool = True) -> Reward:
    """Score a math ``response`` against the LaTeX ground truth ``answer``.

    Args:
        response: the model's text.
        answer: ground truth (LaTeX, e.g. ``"\\frac{3}{7}"``); None or empty scores 0.
        format_weight: reward of a wrong answer that has a non-empty ``\\boxed{}``.
        require_boxed: only a boxed answer counts (DeepScaleR's rule); False lets math-verify
            extract an answer from anywhere in the response when nothing is boxed.

    Safe from any thread: on the main thread math-verify runs here with its own (signal-based)
    time limits; on any other thread it runs in a helper process with a hard limit. Never raises
    for odd input: checker failures score like a wrong answer, with the reason in ``detail``.
    """
    if not isinstance(response, str):
        response = "" if response is None else str(response)
    boxed = last_boxed(response)
    formatted = bool(boxed and boxed.strip())
    if answer is None or not str(answer).strip():
        return Reward(0.0, False, formatted, "no ground truth")
    if not formatted and require_boxed:
        return Reward(0.0, False, False, "no boxed answer")
    target = boxed if formatted else response[-MAX_SCAN_CHARS:]
    try:
        if threading.current_thread() is threading.main_thread():
            verdict = _math_check(target, formatted, str(answer))
        else:
            verdict = _MATH_WORKER.check(target, formatted, str(answer))
    except Exception as exc:  # math-verify's own timeout, parse failures, ...
        verdict = f"checker error: {type(exc).__name__}"
    if verdict == "correct":
        return Reward(1.0, True, formatted, "correct")
    return Reward(format_weight if formatted else 0.0, False, formatted, verdict)


# ----------------------------------------------------------------------------------------------
# code


def code_reward(response: str, problem: Any, *, format_weight: float = 0.1, **run_kwargs: Any) -> Reward:
    """Score a code ``response`` by running its last code block against ``problem.tests`` (see :func:`run_tests`)."""
    code = extract_code(response)
    if code is None:
        return Reward(0.0, False, False, "no code block")
    if getattr(problem, "tests", None) is None:
        raise ValueError(f"problem {getattr(problem, 'problem_id', problem)!r} has no code tests")
    res = run_tests(code, problem.tests, prelude=getattr(problem, "prelude", "") or "", **run_kwargs)
    if res.passed:
        return Reward(1.0, True, True, "passed")
    if res.early_exit:  # an exit before the tests finished is no attempt at the task: no format reward
        return Reward(0.0, False, True, f"exited early: {res.detail}"[:160])
    if res.timed_out:
        why = "timeout"
    else:
        why = res.detail or (res.stderr_tail.strip().splitlines() or ["failed"])[-1]
    return Reward(format_weight, False, True, why[:160])


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
    """Score ``responses[i]`` against ``problems[i]`` (an :class:`integrations.data.problems.Problem`).

    Math is checked in the calling thread (any thread: see :func:`math_reward`); code runs in
    sandboxes, ``workers`` at a time. ``run_kwargs`` go to :func:`run_tests`.
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


if __name__ == "__main__":  # the math helper process
    serve_math_checks()
