"""Rewards for RL rollouts: math answers checked with math-verify, code run against unit tests.

Math (:func:`math_reward`): the response's last ``\\boxed{...}`` is compared with the problem's
LaTeX ground truth by ``math_verify`` (``verify(parse(gold), parse(answer))``, so ``3/7``,
``\\frac{3}{7}`` and ``0.428571`` are the same answer). As DeepScaleR does, only a boxed answer
counts (``require_boxed``). A small *format reward* (``format_weight``, default 0.1) goes to a
wrong answer that at least has a non-empty ``\\boxed{}``, so a policy that solves nothing yet
still gets a signal to move on. Answer extraction is linear in the response and looks at its
last :data:`MAX_SCAN_CHARS` characters only. math-verify's own time limits use ``SIGALRM``,
which works on the main thread only: called from any other thread, the check runs in a helper
process (started once, killed and restarted when a check overruns :data:`MATH_TIMEOUT_S`).

Code (:func:`code_reward`, :func:`run_tests`): the last fenced code block of the response is
checked against the problem's tests. The pass cannot be forged by the code under test:

* The solution runs in its own process (*U*). The problem's tests run in a second process (*T*,
  the harness), never in U: every ``candidate(...)`` call of the tests is sent to U as plain data
  (numbers, strings, lists, tuples, dicts, sets, ``ListNode``/``TreeNode`` values), U calls the
  solution and sends the result back as plain data, and the test's assertions compare T's own
  copies. So nothing the solution does in its process (``os._exit(0)``, ``sys.exit``, ``atexit``,
  patched builtins or ``assert`` helpers, an object whose ``__eq__`` is always true, a redefined
  ``is_same_tree``, output that looks like a pass) can make an assertion hold; U never sees the
  tests (the expected answers), only the arguments it is called with.
* T reports the verdict on a pipe that U does not inherit, authenticated with an HMAC keyed by a
  per-run secret that T reads from another pipe (and closes) before U exists. T is non-dumpable
  (``PR_SET_DUMPABLE`` 0), so U cannot read T's memory, file descriptors or environment. A
  response passes only with that report *and* exit status 0, in time.

Both processes run in a sandbox (:func:`run_program` / :func:`run_tests`; default
``sandbox="bwrap"``, bubblewrap):

* own PID, network, IPC, UTS and mount namespaces: the root file system is a fresh read-only
  tmpfs holding read-only binds of ``/usr`` (and ``/bin``, ``/lib*``, ``/sbin``), the Python
  installation and virtual environment, and ``/etc``'s loader files, ``passwd``, ``group`` and
  ``localtime``; nothing else of the host (no ``/home``, ``/root``, project, ``/sys``, ``/run``).
  The only writable places are a private ``/tmp`` (the working directory) of
  ``max(64 MiB, 4 x max_file_mb)`` and a ``/dev/shm`` of a quarter of that; ``/proc`` shows only
  the sandbox's processes, ``/dev`` only null, zero, full, random, urandom, tty and a new pts;
* an unprivileged uid with no capabilities and ``no_new_privs``: when the trainer runs as root,
  ``setpriv`` drops to a uid of its own per run (``2000000000 + r``, no passwd entry); otherwise
  bubblewrap's user namespace maps the caller's own uid, with every capability dropped;
* resource limits set before any untrusted code runs: address space (``memory_mb``), CPU seconds,
  file size (``max_file_mb``), open files, processes (``max_procs``, RLIMIT_NPROC), no core dumps;
* a wall-clock ``timeout_s``: at the limit the whole sandbox is killed (bubblewrap's process group;
  the PID namespace takes every descendant with it, ``setsid`` or not), and nothing waits for the
  child's pipes to close. When the harness exits, the namespace's other processes die with it.
  stderr is read with a cap (the last :data:`STDERR_CAP` bytes are kept, the rest discarded);
  stdout goes to ``/dev/null``;
* fail closed: the network is reachable only with ``network="allow"``; if the sandbox cannot be
  set up (bubblewrap missing, or user namespaces disabled for a non-root caller),
  :class:`SandboxUnavailable` says how to fix it. ``sandbox="none"`` (which also needs
  ``network="allow"``) runs the same harness with resource limits and a process group only: for
  trusted code.

A code response's reward: 1.0 when the tests pass; 0 when its code ends its own process
(``os._exit``, ``sys.exit``) before the tests finish; else ``format_weight`` when the response
holds a code block, else 0. :func:`run_program` runs a whole program in the same sandbox; its ``passed``
is the program's own exit status 0, which the program can fake, so rewards use :func:`run_tests`.

:func:`score_responses` scores a batch (code runs ``workers`` at a time; math in the calling
thread, any thread) and returns :class:`Reward` records; :func:`make_reward_fn` builds the
``(problems, responses) -> list[Reward]`` the GRPO loop calls. :func:`overlong_penalty` (DAPO's
soft overlong punishment) is added by the loop, which knows the response lengths.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import json
import math
import os
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

__all__ = [
    "Reward",
    "CodeResult",
    "SandboxUnavailable",
    "MAX_SCAN_CHARS",
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
]

#: Answer extraction (``last_boxed``, ``extract_code``) reads at most this many trailing characters.
MAX_SCAN_CHARS = 200_000
#: Bytes of the child's stderr kept (its tail); the rest is read and discarded.
STDERR_CAP = 64 << 10
#: Hard limit of one math check in the helper process (math-verify's own limits are 5 s per step).
MATH_TIMEOUT_S = 30.0

NETWORK_MODES = ("isolate", "require", "allow")  # "require" is the same as "isolate" (kept for old recipes)
SANDBOX_MODES = ("bwrap", "none")


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


def _math_worker_main() -> None:  # pragma: no cover - runs in the helper process
    """Helper process loop: one JSON request per stdin line, one JSON verdict per stdout line."""
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
        root = str(Path(__file__).resolve().parents[2])  # the repository root, above integrations/
        src = f"import sys; sys.path.insert(0, {root!r}); from integrations.rl.rewards import _math_worker_main; _math_worker_main()"
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        env["OMP_NUM_THREADS"] = "1"
        return subprocess.Popen([sys.executable, "-c", src], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, env=env, start_new_session=True)

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
# code: sandbox


class SandboxUnavailable(RuntimeError):
    """Untrusted code cannot be isolated as asked on this machine; the message says how to allow it."""


@dataclasses.dataclass
class CodeResult:
    """Outcome of :func:`run_program` / :func:`run_tests`.

    Attributes:
        passed: ``run_tests``: the harness reported that the tests ran to completion (authenticated),
            and the sandbox exited with status 0, in time. ``run_program``: exit status 0 in time.
        returncode: the sandbox's exit status; None when killed at the time limit.
        timed_out: killed at ``timeout_s``.
        seconds: wall time.
        stderr_tail: the last bytes of stderr (program tracebacks; capped).
        network_isolated: the code ran without network access.
        detail: the harness's one-line reason (e.g. ``"AssertionError at tests line 3"``).
        sandboxed: ran in the namespace sandbox (False for ``sandbox="none"``).
        early_exit: ``run_tests``: the solution ended its own process (``os._exit``, ``sys.exit``,
            ``SystemExit``) before the tests finished.
    """

    passed: bool
    returncode: int | None
    timed_out: bool
    seconds: float
    stderr_tail: str
    network_isolated: bool
    detail: str = ""
    sandboxed: bool = True
    early_exit: bool = False


# Value codec shared by the harness (T) and the solution process (U). Plain data only: JSON
# scalars, and tagged lists for containers; objects of the data classes (ListNode, TreeNode...)
# go into a table keyed by id so long chains and cycles need no recursion; anything else is
# sent as a handle ("H", id) that the other side can call or read attributes of, never compare.
_CODEC = r'''
import json as _json, numbers as _numbers
_BIG = 1 << 12000

class CodecError(ValueError):
    pass

def _encode(value, data_name, to_handle, exact):
    ids, keep, queue, table = {}, [], [], {}
    def enc(v, depth):
        if depth > 200:
            raise CodecError("value nested too deeply")
        t = type(v)
        if v is None or t is bool or t is str:
            return v
        if t is int:
            return v if -_BIG < v < _BIG else ["N", format(v, "x")]
        if t is float:
            return v
        if t is list:
            return ["L"] + [enc(x, depth + 1) for x in v]
        if t is tuple:
            return ["T"] + [enc(x, depth + 1) for x in v]
        if t is dict:
            return ["D"] + [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in v.items()]
        if t is set:
            return ["S"] + [enc(x, depth + 1) for x in v]
        if t is frozenset:
            return ["Z"] + [enc(x, depth + 1) for x in v]
        if t is bytes or t is bytearray:
            return ["B", bytes(v).hex()]
        if t is complex:
            return ["C", v.real, v.imag]
        name = data_name(v)
        if name is not None:
            i = ids.get(id(v))
            if i is None:
                i = ids[id(v)] = len(ids)
                keep.append(v)
                queue.append((i, v, name))
            return ["O", i]
        if not exact:  # the solution's side: convert builtin subclasses and numeric types honestly
            if isinstance(v, str):
                return str.__str__(v)
            if isinstance(v, int):
                return enc(int.__index__(v), depth)
            if isinstance(v, float):
                return float.__float__(v)
            if isinstance(v, list):
                return enc(list(v), depth)
            if isinstance(v, tuple):
                return enc(tuple(v), depth)
            if isinstance(v, dict):
                return enc(dict(v), depth)
            if isinstance(v, (set, frozenset)):
                return enc(set(v) if isinstance(v, set) else frozenset(v), depth)
            if type(v).__module__ == "numpy" and hasattr(v, "item") and getattr(v, "ndim", None) == 0:
                return enc(v.item(), depth)  # numpy scalars (np.int64, np.bool_, ...) as Python scalars
            if isinstance(v, _numbers.Integral):
                return enc(int(v), depth)
            if isinstance(v, _numbers.Real):
                return float(v)
        h = to_handle(v)
        if h is None:
            raise CodecError(f"cannot send a {t.__name__} to the solution")
        return ["H", h]
    root = enc(value, 0)
    while queue:
        i, v, name = queue.pop()
        attrs = {}
        for k, x in vars(v).items():
            if isinstance(k, str) and not k.startswith("__"):
                attrs[k] = enc(x, 1)
        table[str(i)] = [name, attrs]
    return {"v": root, "o": table}

def _decode(msg, make_obj, set_attr, get_handle):
    if type(msg) is not dict or type(msg.get("o")) is not dict:
        raise CodecError("malformed value")
    table = msg["o"]
    made, pending = {}, []
    def obj(i):
        if type(i) is not int:
            raise CodecError("malformed object reference")
        o = made.get(i)
        if o is None:
            entry = table.get(str(i))
            if type(entry) is not list or len(entry) != 2 or type(entry[0]) is not str or type(entry[1]) is not dict:
                raise CodecError("malformed object")
            o = made[i] = make_obj(entry[0])
            pending.append(i)
        return o
    def dec(x, depth):
        if depth > 200:
            raise CodecError("value nested too deeply")
        t = type(x)
        if x is None or t is bool or t is int or t is float or t is str:
            return x
        if t is not list or not x or type(x[0]) is not str:
            raise CodecError("malformed value")
        tag, rest = x[0], x[1:]
        if tag == "L":
            return [dec(y, depth + 1) for y in rest]
        if tag == "T":
            return tuple(dec(y, depth + 1) for y in rest)
        if tag == "S":
            return set(dec(y, depth + 1) for y in rest)
        if tag == "Z":
            return frozenset(dec(y, depth + 1) for y in rest)
        if tag == "D":
            out = {}
            for pair in rest:
                if type(pair) is not list or len(pair) != 2:
                    raise CodecError("malformed dict")
                out[dec(pair[0], depth + 1)] = dec(pair[1], depth + 1)
            return out
        if len(rest) == 1 and tag == "N" and type(rest[0]) is str and len(rest[0]) < 1000000:
            return int(rest[0], 16)
        if len(rest) == 1 and tag == "B" and type(rest[0]) is str:
            return bytes.fromhex(rest[0])
        if len(rest) == 2 and tag == "C" and all(type(y) in (int, float) for y in rest):
            return complex(rest[0], rest[1])
        if len(rest) == 1 and tag == "O":
            return obj(rest[0])
        if len(rest) == 1 and tag == "H" and type(rest[0]) is int:
            return get_handle(rest[0])
        raise CodecError("malformed value")
    root = dec(msg["v"], 0)
    while pending:
        i = pending.pop()
        o = made[i]
        for k, x in table[str(i)][1].items():
            if type(k) is not str or not k.isidentifier() or k.startswith("__"):
                raise CodecError("malformed attribute")
            set_attr(o, k, dec(x, 1))
    return root
'''

# The solution's process (U). Limits first, then the prelude and the solution, then it serves the
# harness's calls. Nothing here is trusted: the harness only ever reads plain data from it.
_SOLUTION_LAUNCHER = r'''
import os, sys, resource
_rfd, _wfd = int(sys.argv[1]), int(sys.argv[2])
_mem, _cpu, _fsize, _nofile, _nproc = (int(x) for x in sys.argv[3:8])
for _lim, _v in ((resource.RLIMIT_AS, _mem), (resource.RLIMIT_DATA, _mem)):
    if _v > 0:
        resource.setrlimit(_lim, (_v, _v))
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (_fsize, _fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_NOFILE, (_nofile, _nofile))
resource.setrlimit(resource.RLIMIT_NPROC, (_nproc, _nproc))
''' + _CODEC + r'''
_rf = os.fdopen(_rfd, "rb")
_wf = os.fdopen(_wfd, "wb")
_init = _json.loads(_rf.readline())
_ns = {"__name__": "__main__", "__builtins__": __builtins__}
sys.argv = ["solution.py"]
if _init["mode"] == "program":
    del _rf, _wf
    exec(compile(_init["code"], "program.py", "exec"), _ns)
    sys.exit(0)

def _send(obj):
    _wf.write(_json.dumps(obj, separators=(",", ":")).encode() + b"\n")
    _wf.flush()

def _why(exc):
    return f"{type(exc).__name__}: {exc}"[:300]

try:
    exec(compile(_init["prelude"], "<prelude>", "exec"), _ns)
    _pre = dict(_ns)
    exec(compile(_init["code"], "<solution>", "exec"), _ns)
except BaseException as _e:
    import traceback
    traceback.print_exc()
    _send({"err": "the solution raised " + _why(_e), "exit": isinstance(_e, (SystemExit, KeyboardInterrupt))})
    os._exit(1)
_handles = {}
_data_names = frozenset(_init["data_classes"])

def _to_handle(v):
    _handles[len(_handles)] = v
    return len(_handles) - 1

def _data_name(v):
    n = type(v).__name__
    return n if n in _data_names and hasattr(v, "__dict__") else None

def _make_obj(name):
    cls = _ns.get(name)
    if not isinstance(cls, type):
        raise CodecError(f"the solution has no class {name}")
    return cls.__new__(cls)

def _get_handle(i):
    if i not in _handles:
        raise CodecError("unknown handle")
    return _handles[i]

def _out(v):
    return _encode(v, _data_name, _to_handle, False)

def _in(m):
    return _decode(m, _make_obj, setattr, _get_handle)

_send({"ok": None})
for _line in _rf:
    try:
        _req = _json.loads(_line)
        _op = _req["op"]
        if _op == "globals":
            _reply = _out({n: _ns[n] for n in _req["names"] if n in _ns and _ns[n] is not _pre.get(n, _pre)})
        elif _op == "getattr":
            _reply = _out(getattr(_get_handle(_req["h"]), _req["name"]))
        elif _op == "call":
            _reply = _out(_get_handle(_req["h"])(*_in(_req["a"]), **_in(_req["k"])))
        else:
            raise CodecError(f"unknown request {_op!r}")
        _send({"ok": _reply})
    except BaseException as _e:
        _send({"err": _why(_e), "exit": isinstance(_e, (SystemExit, KeyboardInterrupt))})
'''

# The harness (T). Trusted: it runs before any untrusted code exists, makes itself non-dumpable,
# reads its inputs and the per-run secret from a pipe and closes it, starts the solution's
# process without its pipes, runs the problem's tests, and writes the authenticated verdict.
_HARNESS_LAUNCHER = r'''
import os, sys, resource
_in_fd, _rep_fd = int(sys.argv[1]), int(sys.argv[2])
def _report(ok, detail, mac="", early_exit=False):
    import json
    line = json.dumps({"pass": bool(ok), "detail": str(detail)[:500], "mac": mac, "early_exit": bool(early_exit)}) + "\n"
    os.write(_rep_fd, line.encode()[:8192])
def _main():
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 0
        _report(False, "harness: cannot make itself non-dumpable")
        return 1
    def read_exactly(n):  # length-framed: no waiting for EOF, which a stray copy of the pipe could delay
        buf = bytearray()
        while len(buf) < n:
            b = os.read(_in_fd, min(1 << 16, n - len(buf)))
            if not b:
                raise EOFError("input pipe closed early")
            buf += b
        return bytes(buf)
    chunks = [read_exactly(int.from_bytes(read_exactly(8), "big"))]
    os.close(_in_fd)
    import ast, builtins, hashlib, hmac, json, subprocess, traceback
    cfg = json.loads(b"".join(chunks))
    del chunks
    secret = bytes.fromhex(cfg.pop("secret"))
    os.set_inheritable(_rep_fd, False)
    mem = int(cfg["memory"])
    own_mem = max(mem + (256 << 20), 512 << 20) if mem > 0 else 0
    for lim, v in ((resource.RLIMIT_AS, own_mem), (resource.RLIMIT_DATA, own_mem)):
        if v > 0:
            resource.setrlimit(lim, (v, v))
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu"], cfg["cpu"] + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    exec(_CODEC, globals())
    to_u_r, to_u_w = os.pipe()
    from_u_r, from_u_w = os.pipe()
    argv = [sys.executable, "-I", "-c", cfg["solution_launcher"], str(to_u_r), str(from_u_w),
            str(mem), str(cfg["cpu"]), str(cfg["fsize"]), str(cfg["nofile"]), str(cfg["nproc"])]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, pass_fds=(to_u_r, from_u_w),
                            close_fds=True, env=dict(os.environ))
    os.close(to_u_r)
    os.close(from_u_w)
    wf = os.fdopen(to_u_w, "wb")
    rf = os.fdopen(from_u_r, "rb")
    cap = int(cfg["reply_cap"])
    mode = cfg["mode"]
    prelude_tree = ast.parse(cfg["prelude"])
    data_classes = [n.name for n in prelude_tree.body if isinstance(n, ast.ClassDef)]

    def send(obj):
        wf.write(json.dumps(obj, separators=(",", ":")).encode() + b"\n")
        wf.flush()

    try:
        send({"mode": mode, "prelude": cfg["prelude"], "code": cfg["code"], "data_classes": data_classes})
    except OSError:
        pass
    if mode == "program":
        rc = proc.wait()
        ok = rc == 0
        mac = hmac.new(secret, b"das-code-pass", hashlib.sha256).hexdigest() if ok else ""
        _report(ok, "exit status 0" if ok else f"exit status {rc}", mac)
        return 0 if ok else 1

    class RemoteError(Exception):
        """The solution raised, or its process failed, or it sent something that is not plain data.
        ``exit``: the solution ended its process (exit status >= 0, SystemExit) before the tests finished."""
        def __init__(self, msg, exit=False):
            super().__init__(msg)
            self.exit = exit

    def died():
        try:
            rc = proc.wait(1)
        except subprocess.TimeoutExpired:
            return RemoteError("the solution's process stopped answering")
        return RemoteError(f"the solution's process exited (status {rc}) before the tests finished", exit=rc >= 0)

    def receive():
        line = rf.readline(cap + 1)
        if not line:
            raise died()
        if len(line) > cap or not line.endswith(b"\n"):
            raise RemoteError(f"the solution sent more than {cap} bytes")
        old = sys.getrecursionlimit()
        sys.setrecursionlimit(1000)
        try:
            msg = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise RemoteError(f"the solution sent a malformed reply ({type(exc).__name__})") from None
        finally:
            sys.setrecursionlimit(old)
        if type(msg) is not dict:
            raise RemoteError("the solution sent a malformed reply")
        if "err" in msg:
            raise RemoteError(str(msg["err"])[:300], exit=msg.get("exit") is True)
        if "ok" not in msg:
            raise RemoteError("the solution sent a malformed reply")
        return msg["ok"]

    tns = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(cfg["prelude"], "<prelude>", "exec"), tns)
    classes = {n: tns[n] for n in data_classes if isinstance(tns.get(n), type)}

    class Remote:
        """A handle on an object of the solution's process: call it or read its attributes; it
        equals only itself and has no truth value."""
        __slots__ = ("_h",)
        def __init__(self, h):
            object.__setattr__(self, "_h", h)
        def __call__(self, *args, **kwargs):
            return request({"op": "call", "h": self._h, "a": out(list(args)), "k": out(dict(kwargs))})
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return request({"op": "getattr", "h": self._h, "name": name})
        def __setattr__(self, name, value):
            raise TypeError("cannot set attributes of the solution's objects")
        def __bool__(self):
            raise TypeError("the solution returned an object that is not plain data")
        def __repr__(self):
            return f"<solution object #{self._h}>"

    def data_name(v):
        n = type(v).__name__
        return n if classes.get(n) is type(v) else None

    def to_handle(v):
        return v._h if type(v) is Remote else None

    def make_obj(name):
        cls = classes.get(name)
        if cls is None:
            raise CodecError(f"unknown class {name!r}")
        return object.__new__(cls)

    def set_attr(o, k, v):
        o.__dict__[k] = v

    def out(v):
        return _encode(v, data_name, to_handle, True)

    def request(req):
        try:
            send(req)
        except OSError:
            raise died() from None
        m = receive()
        try:
            return _decode(m, make_obj, set_attr, Remote)
        except (CodecError, TypeError, ValueError, RecursionError, KeyError) as exc:
            raise RemoteError(f"the solution sent a malformed value ({exc})") from None

    try:
        receive()  # the solution's module ran to its end
        tests = cfg["tests"]
        tree = ast.parse(tests)
        # Entry points: names in the arguments of the tests' top-level calls (check(Solution().f),
        # check(add)): always the solution's, even where the prelude or builtins have that name.
        # Any other name the tests use comes from the harness (prelude, builtins, the tests' own
        # definitions) when it has one, so a solution cannot replace a checking helper; names the
        # harness lacks (a helper the problem asked for, e.g. HumanEval's poly) are the solution's.
        entry = set()
        bound = set()
        for st in tree.body:
            if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call):
                for arg in [*st.value.args, *(k.value for k in st.value.keywords)]:
                    entry |= {n.id for n in ast.walk(arg) if isinstance(n, ast.Name)}
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.add(st.name)
            elif isinstance(st, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in (st.targets if isinstance(st, ast.Assign) else [st.target]):
                    bound |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
            elif isinstance(st, (ast.Import, ast.ImportFrom)):
                bound |= {(a.asname or a.name).split(".")[0] for a in st.names}
        loads = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        entry -= bound
        wanted = sorted(entry | (loads - bound - set(tns) - set(dir(builtins))))
        got = request({"op": "globals", "names": wanted}) if wanted else {}
        if type(got) is not dict:
            raise RemoteError("malformed globals")
        for name in wanted:
            if name in got:
                tns[name] = got[name]
            elif name in entry:
                tns.pop(name, None)  # the solution does not define it: the tests fail with NameError
        exec(compile(tree, "<tests>", "exec"), tns)
    except BaseException as exc:
        where = ""
        for fs in traceback.extract_tb(exc.__traceback__):
            if fs.filename == "<tests>":
                where = f" at tests line {fs.lineno}"
        detail = f"{type(exc).__name__}{where}" + (f": {exc}" if str(exc) else "")
        try:
            traceback.print_exc()
        except BaseException:
            pass
        proc.kill()
        _report(False, detail, early_exit=getattr(exc, "exit", False) is True and type(exc).__name__ == "RemoteError")
        return 1
    proc.kill()
    _report(True, "passed", hmac.new(secret, b"das-code-pass", hashlib.sha256).hexdigest())
    return 0
try:
    _rc = _main()
except BaseException as _e:
    try:
        _report(False, f"harness error: {type(_e).__name__}: {_e}")
    except BaseException:
        pass
    _rc = 1
for _f in (sys.stdout, sys.stderr):
    try:
        _f.flush()
    except BaseException:
        pass
os._exit(_rc)
'''.replace("exec(_CODEC, globals())", "exec(" + repr(_CODEC) + ", globals())")


# Run in the sandbox once per setting: it must not be able to become root or hold any capability.
_PROBE = r"""
import os, sys
try:
    os.setuid(0)
except OSError:
    pass
else:
    print("setuid(0) worked"); sys.exit(3)
caps = {l.split()[0]: int(l.split()[1], 16) for l in open("/proc/self/status") if l.startswith("Cap")}
if os.getuid() == 0 or any(caps.values()):
    print(f"uid {os.getuid()}, capabilities {caps}"); sys.exit(3)
"""
_PROBE_LOCK = threading.Lock()
_PROBED: dict[tuple, tuple[list[str] | None, str]] = {}
_UID_BASE = 2_000_000_000


def _python_paths(python: str) -> list[str]:
    """Directories an interpreter needs (prefixes, its real location), from the interpreter itself."""
    src = ("import sys, os, json; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, "
           "os.path.dirname(os.path.realpath(sys.executable))]))")
    r = subprocess.run([python, "-I", "-c", src], capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    if r.returncode != 0:
        raise SandboxUnavailable(f"cannot start the interpreter {python!r}: {r.stderr.strip()[-300:]}")
    paths = {os.path.realpath(p) for p in json.loads(r.stdout)} | {os.path.dirname(os.path.abspath(python))}
    # Keep a path's prefix instead of the path (a bin dir inside a prefix); drop the host's top dirs.
    paths = {p for p in paths if p not in ("/", "/usr", "/bin", "/lib", "/lib64", "/sbin")}
    keep = sorted(p for p in paths if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in paths))
    return keep


def _bwrap_args(python: str, network: str, max_tmp_bytes: int) -> list[str]:
    """bubblewrap's arguments up to (not including) the command."""
    exe = shutil.which("bwrap")
    if exe is None:
        raise SandboxUnavailable(
            "cannot sandbox untrusted code: bubblewrap is not installed (apt-get install bubblewrap, or run "
            "install.sh as root). To run code without the sandbox (trusted code only), pass "
            "sandbox='none' and network='allow' (recipe: reward.sandbox=none reward.network=allow).")
    args = [exe, "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent",
            "--new-session", "--perms", "1777", "--size", str(int(max_tmp_bytes)), "--tmpfs", "/tmp"]
    if network != "allow":
        args.append("--unshare-net")
    if os.geteuid() != 0:
        args += ["--unshare-user", "--cap-drop", "ALL"]
    made = {"/", "/tmp"}

    def parents(path: str) -> None:
        parts = Path(path).parts
        for k in range(2, len(parts)):
            d = str(Path(*parts[:k]))
            if d not in made:
                made.add(d)
                args.extend(["--perms", "0755", "--dir", d])

    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args.extend(["--symlink", os.readlink(top), top])
        elif os.path.isdir(top):
            args.extend(["--ro-bind", top, top])
        made.add(top)
    for f in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/passwd", "/etc/group"):
        if os.path.exists(f):
            parents(f)
            args.extend(["--ro-bind", f, f])
    for p in _python_paths(python):
        if any(p == t or p.startswith(t + "/") for t in ("/usr", "/bin", "/sbin", "/lib", "/lib64")):
            continue
        parents(p)
        args.extend(["--ro-bind", p, p])
        made.add(p)
    args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(int(max_tmp_bytes) // 4), "--tmpfs", "/dev/shm",
             "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp"]
    return args


def _drop_privileges(uid: int) -> list[str]:
    """Command prefix (inside the sandbox) that leaves root for ``uid`` with no capabilities."""
    exe = shutil.which("setpriv") or "/usr/bin/setpriv"
    return [exe, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs", "--inh-caps=-all",
            "--bounding-set=-all", "--"]


def _sandbox_prefix(python: str, network: str, sandbox: str, max_tmp_bytes: int) -> list[str] | None:
    """The command prefix that sandboxes ``python`` (None for ``sandbox="none"``); probed once per setting.

    Raises :class:`SandboxUnavailable` (with what to do) when it cannot be had.
    """
    if network not in NETWORK_MODES:
        raise ValueError(f"network must be one of {list(NETWORK_MODES)}, got {network!r}")
    if sandbox not in SANDBOX_MODES:
        raise ValueError(f"sandbox must be one of {list(SANDBOX_MODES)}, got {sandbox!r}")
    if sandbox == "none":
        if network != "allow":
            raise SandboxUnavailable(
                "sandbox='none' cannot cut the network: pass network='allow' as well to run untrusted code "
                "with resource limits only (trusted code only), or keep sandbox='bwrap'")
        return None
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailable("the code sandbox needs Linux (bubblewrap); pass sandbox='none' and network='allow' "
                                 "to run code with resource limits only (trusted code only)")
    key = (python, network, max_tmp_bytes, os.geteuid())
    with _PROBE_LOCK:
        if key not in _PROBED:
            try:
                args = _bwrap_args(python, network, max_tmp_bytes)
                drop = _drop_privileges(_UID_BASE + 1) if os.geteuid() == 0 else []
                r = subprocess.run([*args, "--", *drop, python, "-I", "-c", _PROBE], capture_output=True,
                                   text=True, timeout=60, env={"PATH": "/usr/bin:/bin"}, stdin=subprocess.DEVNULL)
                if r.returncode == 0:
                    _PROBED[key] = (args, "")
                elif r.returncode == 3:
                    _PROBED[key] = (None, f"the sandboxed process kept privileges ({r.stdout.strip()}).")
                else:
                    hint = ("" if os.geteuid() == 0 else " Unprivileged user namespaces may be disabled: enable them "
                            "(sysctl -w kernel.unprivileged_userns_clone=1; on Ubuntu 24.04+ also "
                            "kernel.apparmor_restrict_unprivileged_userns=0), or run as root.")
                    _PROBED[key] = (None, f"bubblewrap failed here: {r.stderr.strip()[-400:]!r}.{hint}")
            except SandboxUnavailable as exc:
                _PROBED[key] = (None, str(exc))
            except (OSError, subprocess.TimeoutExpired) as exc:
                _PROBED[key] = (None, f"bubblewrap could not be run: {exc}")
        args, why = _PROBED[key]
    if args is None:
        if why.startswith("cannot sandbox"):
            raise SandboxUnavailable(why)
        raise SandboxUnavailable(f"cannot sandbox untrusted code: {why} To run code without the sandbox (trusted code "
                                 "only), pass sandbox='none' and network='allow' (recipe: reward.sandbox=none reward.network=allow).")
    return list(args)


def check_sandbox(network: str = "isolate", sandbox: str = "bwrap", python: str | None = None) -> None:
    """Raise :class:`SandboxUnavailable` (saying how to allow it) or ``ValueError`` unless code can run as asked.

    Call it before a run that will score code, so a missing sandbox stops it before any engine starts.
    """
    _sandbox_prefix(python or sys.executable, network, sandbox, 64 << 20)


def _check_limits(timeout_s: float, memory_mb: int, max_file_mb: int, max_procs: int) -> None:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
    for name, v, lo in (("memory_mb", memory_mb, 0), ("max_file_mb", max_file_mb, 1), ("max_procs", max_procs, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


def _run_sandboxed(cfg: dict[str, Any], *, timeout_s: float, memory_mb: int, max_file_mb: int, max_procs: int,
                   network: str, sandbox: str, python: str | None) -> CodeResult:
    _check_limits(timeout_s, memory_mb, max_file_mb, max_procs)
    python = python or sys.executable
    prefix = _sandbox_prefix(python, network, sandbox, max(64 << 20, 4 * (int(max_file_mb) << 20)))
    secret = secrets.token_bytes(32)
    cpu = int(math.ceil(timeout_s)) + 1
    payload = json.dumps({**cfg, "secret": secret.hex(), "memory": int(memory_mb) << 20, "cpu": cpu,
                          "fsize": int(max_file_mb) << 20, "nofile": 256, "nproc": int(max_procs),
                          "reply_cap": 32 << 20, "solution_launcher": _SOLUTION_LAUNCHER}).encode()
    payload = len(payload).to_bytes(8, "big") + payload
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONHASHSEED": "0", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
    in_r, in_w = os.pipe()
    rep_r, rep_w = os.pipe()
    harness = [python, "-I", "-c", _HARNESS_LAUNCHER, str(in_r), str(rep_w)]
    tmp = None
    if prefix is None:
        tmp = tempfile.mkdtemp(prefix="das-code-")
        cmd, cwd = harness, tmp
        env["HOME"] = tmp
    else:
        drop = _drop_privileges(_UID_BASE + secrets.randbelow(100_000_000)) if os.geteuid() == 0 else []
        cmd, cwd = [*prefix, "--", *drop, *harness], "/"
    t0 = time.perf_counter()
    deadline = t0 + float(timeout_s)
    try:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, pass_fds=(in_r, rep_w), start_new_session=True)
    except BaseException:
        for fd in (in_r, in_w, rep_r, rep_w):
            os.close(fd)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.close(in_r)
    os.close(rep_w)

    def feed() -> None:
        try:
            view = memoryview(payload)
            while view:
                n = os.write(in_w, view[: 1 << 16])
                view = view[n:]
        except OSError:
            pass
        finally:
            os.close(in_w)

    writer = threading.Thread(target=feed, name="das-code-input", daemon=True)
    writer.start()
    err_tail = bytearray()
    report = bytearray()
    sel = selectors.DefaultSelector()
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    sel.register(rep_r, selectors.EVENT_READ, "rep")
    timed_out = False
    exited_at: float | None = None
    try:
        while sel.get_map():
            now = time.perf_counter()
            if proc.poll() is not None and exited_at is None:
                exited_at = now
            if exited_at is not None and now - exited_at > 1.0:
                break  # the sandbox is gone; whatever still holds a pipe is not waited for
            if exited_at is None and now >= deadline:
                timed_out = True
                break
            wait = min(0.05, max(0.0, deadline - now)) if exited_at is None else 0.05
            for key, _ in sel.select(wait):
                fd = key.fileobj if isinstance(key.fileobj, int) else key.fileobj.fileno()
                try:
                    chunk = os.read(fd, 1 << 16)
                except OSError:
                    chunk = b""
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.data == "err":
                    err_tail += chunk
                    if len(err_tail) > 2 * STDERR_CAP:
                        del err_tail[: len(err_tail) - STDERR_CAP]
                elif len(report) < 8192:
                    report += chunk
    finally:
        sel.close()
        if timed_out or proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.kill()
            except ProcessLookupError:
                pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        if prefix is None:
            try:  # sandbox="none": the harness's process group (its descendants that left it are not reached)
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        proc.stderr.close()
        os.close(rep_r)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.perf_counter() - t0
    rc = None if timed_out else proc.returncode
    ok, detail, early = False, "timeout" if timed_out else "", False
    if not timed_out:
        try:
            rep = json.loads(bytes(report).split(b"\n", 1)[0])
            want = hmac.new(secret, b"das-code-pass", hashlib.sha256).hexdigest()
            ok = bool(rep.get("pass")) and isinstance(rep.get("mac"), str) and hmac.compare_digest(rep["mac"], want)
            detail = str(rep.get("detail", ""))[:300]
            early = not ok and rep.get("early_exit") is True
        except (ValueError, AttributeError):
            detail = "the harness sent no verdict" + (f" (exit status {rc})" if rc is not None else "")
    tail = bytes(err_tail[-STDERR_CAP:]).decode("utf-8", "replace")
    return CodeResult(bool(ok and rc == 0), rc, timed_out, seconds, tail, network != "allow" and prefix is not None, detail,
                      prefix is not None, early)


def run_program(
    program: str,
    *,
    timeout_s: float = 6.0,
    memory_mb: int = 1024,
    max_file_mb: int = 16,
    max_procs: int = 32,
    network: str = "isolate",
    sandbox: str = "bwrap",
    python: str | None = None,
) -> CodeResult:
    """Run a whole untrusted Python program in the sandbox (see the module doc).

    ``passed`` is "exited with status 0 in time": the program's own claim, which it can fake
    (``os._exit(0)``). Score solutions with :func:`run_tests` / :func:`code_reward` instead.

    Args:
        program: Python source, run as ``__main__`` in an empty private ``/tmp``.
        timeout_s: wall-clock limit (the CPU limit is ``ceil(timeout_s) + 1`` seconds per process).
        memory_mb: address-space limit (0: none).
        max_file_mb: largest file the program may write (the private ``/tmp`` holds 4x that, >= 64 MiB).
        max_procs: RLIMIT_NPROC of the program (its processes and threads).
        network: ``"isolate"`` (default; ``"require"`` is the same) or ``"allow"``.
        sandbox: ``"bwrap"`` (default) or ``"none"`` (resource limits only; needs ``network="allow"``).
        python: interpreter (default: this one, so the same site-packages, e.g. sortedcontainers).

    Raises:
        SandboxUnavailable: the sandbox cannot be set up here (the message says how to allow it).
        ValueError: bad arguments.
    """
    if not isinstance(program, str):
        raise ValueError(f"program must be a str, got {type(program).__name__}")
    return _run_sandboxed({"mode": "program", "code": program, "prelude": "", "tests": ""}, timeout_s=timeout_s,
                          memory_mb=memory_mb, max_file_mb=max_file_mb, max_procs=max_procs, network=network,
                          sandbox=sandbox, python=python)


def run_tests(
    solution: str,
    tests: str,
    *,
    prelude: str = "",
    timeout_s: float = 6.0,
    memory_mb: int = 1024,
    max_file_mb: int = 16,
    max_procs: int = 32,
    network: str = "isolate",
    sandbox: str = "bwrap",
    python: str | None = None,
) -> CodeResult:
    """Check untrusted ``solution`` source against trusted ``tests`` (e.g. ``check(candidate)`` code).

    The solution's process runs ``prelude`` then ``solution``; the harness process runs ``prelude``
    then ``tests``, where every name the tests use that the harness lacks (``Solution``, an
    ``entry_point`` function...) stands for the solution's object of that name, reached by
    plain-data calls (see the module doc). ``passed`` iff the tests ran to completion (an
    authenticated report from the harness) and the sandbox exited with status 0 in time.
    Arguments as in :func:`run_program`.
    """
    for name, v in (("solution", solution), ("tests", tests), ("prelude", prelude)):
        if not isinstance(v, str):
            raise ValueError(f"{name} must be a str, got {type(v).__name__}")
    return _run_sandboxed({"mode": "tests", "code": solution, "prelude": prelude, "tests": tests}, timeout_s=timeout_s,
                          memory_mb=memory_mb, max_file_mb=max_file_mb, max_procs=max_procs, network=network,
                          sandbox=sandbox, python=python)


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
