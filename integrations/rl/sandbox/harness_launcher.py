"""The harness (T): the trusted process that runs a problem's tests against the solution's process.

``python -I -m integrations.rl.sandbox.harness_launcher IN_FD REPORT_FD`` (started by
:func:`integrations.rl.code_sandbox.run_tests`, through :func:`integrations.rl.sandbox.command`).
It runs before any untrusted code exists: makes itself non-dumpable (``PR_SET_DUMPABLE`` 0, so the
solution cannot read its memory, file descriptors or environment), reads its length-framed JSON
input (the tests, the prelude, the solution, the limits and the per-run secret) from ``IN_FD`` and
closes it, then starts the solution's process (:mod:`.solution_launcher`) without its pipes,
runs the tests with every call of the solution made through plain data (:mod:`.codec`), and
writes one JSON verdict line on ``REPORT_FD``: ``{"pass", "detail", "mac", "early_exit"}``, where
``mac`` (an HMAC of the secret) authenticates a pass.

Every ``candidate(...)`` call of the tests is sent to the solution's process as plain data
(numbers, strings, lists, tuples, dicts, sets, ``ListNode``/``TreeNode`` values), the solution's
result comes back as plain data, and the tests' assertions compare the harness's own copies. So
nothing the solution does in its process (``os._exit(0)``, ``sys.exit``, ``atexit``, patched
builtins or ``assert`` helpers, an object whose ``__eq__`` is always true, a redefined
``is_same_tree``, output that looks like a pass) can make an assertion hold, and the solution
never sees the tests (the expected answers), only the arguments it is called with.

Names the tests use: names in the arguments of the tests' top-level calls (``check(Solution().f)``,
``check(add)``) are always the solution's, even where the prelude or builtins have that name. Any
other name the tests use comes from the harness (prelude, builtins, the tests' own definitions)
when it has one, so a solution cannot replace a checking helper; names the harness lacks (a
helper the problem asked for, e.g. HumanEval's ``poly``) are the solution's.
"""

from __future__ import annotations

import ast
import builtins
import ctypes
import hashlib
import hmac
import json
import os
import resource
import subprocess
import sys
import traceback
from typing import Any

from . import SOLUTION, command
from .codec import CodecError, decode, encode

PASS_MESSAGE = b"das-code-pass"  # what the verdict's HMAC signs
REPORT_CAP = 8192  # bytes of the verdict line


class RemoteError(Exception):
    """The solution raised, or its process failed, or it sent something that is not plain data.

    ``exit``: the solution ended its process (exit status >= 0, SystemExit) before the tests finished.
    """

    def __init__(self, msg: str, exit: bool = False):
        super().__init__(msg)
        self.exit = exit


def report(fd: int, ok: bool, detail: str, mac: str = "", early_exit: bool = False) -> None:
    """Write the verdict line on ``fd``."""
    line = json.dumps({"pass": bool(ok), "detail": str(detail)[:500], "mac": mac, "early_exit": bool(early_exit)}) + "\n"
    os.write(fd, line.encode()[:REPORT_CAP])


def read_input(fd: int) -> dict:
    """The length-framed JSON input on ``fd`` (no waiting for EOF, which a stray copy of the pipe could delay); closes ``fd``."""

    def read_exactly(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            b = os.read(fd, min(1 << 16, n - len(buf)))
            if not b:
                raise EOFError("input pipe closed early")
            buf += b
        return bytes(buf)

    data = read_exactly(int.from_bytes(read_exactly(8), "big"))
    os.close(fd)
    return json.loads(data)


def names_in_tests(tree: ast.Module) -> tuple[set[str], set[str], set[str]]:
    """The tests' entry points (names in the arguments of top-level calls), the names they bind
    at top level, and every name they load."""
    entry: set[str] = set()
    bound: set[str] = set()
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
    return entry - bound, bound, loads


def run(cfg: dict, rep_fd: int) -> int:
    """Start the solution's process, run the tests, report; returns the harness's exit status."""
    secret = bytes.fromhex(cfg.pop("secret"))
    os.set_inheritable(rep_fd, False)
    mem = int(cfg["memory"])
    own_mem = max(mem + (256 << 20), 512 << 20) if mem > 0 else 0
    for lim in (resource.RLIMIT_AS, resource.RLIMIT_DATA):
        if own_mem > 0:
            resource.setrlimit(lim, (own_mem, own_mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu"], cfg["cpu"] + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    to_u_r, to_u_w = os.pipe()
    from_u_r, from_u_w = os.pipe()
    argv = command(sys.executable, SOLUTION, str(to_u_r), str(from_u_w), str(mem), str(cfg["cpu"]), str(cfg["fsize"]),
                   str(cfg["nofile"]), str(cfg["nproc"]))
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

    def send(obj: Any) -> None:
        wf.write(json.dumps(obj, separators=(",", ":")).encode() + b"\n")
        wf.flush()

    try:
        send({"mode": mode, "prelude": cfg["prelude"], "code": cfg["code"], "data_classes": data_classes})
    except OSError:
        pass
    if mode == "program":
        rc = proc.wait()
        ok = rc == 0
        mac = hmac.new(secret, PASS_MESSAGE, hashlib.sha256).hexdigest() if ok else ""
        report(rep_fd, ok, "exit status 0" if ok else f"exit status {rc}", mac)
        return 0 if ok else 1

    def died() -> RemoteError:
        try:
            rc = proc.wait(1)
        except subprocess.TimeoutExpired:
            return RemoteError("the solution's process stopped answering")
        return RemoteError(f"the solution's process exited (status {rc}) before the tests finished", exit=rc >= 0)

    def receive() -> Any:
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

    tns: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(cfg["prelude"], "<prelude>", "exec"), tns)
    classes = {n: tns[n] for n in data_classes if isinstance(tns.get(n), type)}

    class Remote:
        """A handle on an object of the solution's process: call it or read its attributes; it
        equals only itself and has no truth value."""

        __slots__ = ("_h",)

        def __init__(self, h: int):
            object.__setattr__(self, "_h", h)

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return request({"op": "call", "h": self._h, "a": out(list(args)), "k": out(dict(kwargs))})

        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return request({"op": "getattr", "h": self._h, "name": name})

        def __setattr__(self, name: str, value: Any) -> None:
            raise TypeError("cannot set attributes of the solution's objects")

        def __bool__(self) -> bool:
            raise TypeError("the solution returned an object that is not plain data")

        def __repr__(self) -> str:
            return f"<solution object #{self._h}>"

    def data_name(v: Any) -> str | None:
        n = type(v).__name__
        return n if classes.get(n) is type(v) else None

    def to_handle(v: Any) -> int | None:
        return v._h if type(v) is Remote else None

    def make_obj(name: str) -> Any:
        cls = classes.get(name)
        if cls is None:
            raise CodecError(f"unknown class {name!r}")
        return object.__new__(cls)

    def set_attr(o: Any, k: str, v: Any) -> None:
        o.__dict__[k] = v

    def out(v: Any) -> dict:
        return encode(v, data_name, to_handle, True)

    def request(req: dict) -> Any:
        try:
            send(req)
        except OSError:
            raise died() from None
        m = receive()
        try:
            return decode(m, make_obj, set_attr, Remote)
        except (CodecError, TypeError, ValueError, RecursionError, KeyError) as exc:
            raise RemoteError(f"the solution sent a malformed value ({exc})") from None

    try:
        receive()  # the solution's module ran to its end
        tree = ast.parse(cfg["tests"])
        entry, bound, loads = names_in_tests(tree)
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
        report(rep_fd, False, detail, early_exit=isinstance(exc, RemoteError) and exc.exit is True)
        return 1
    proc.kill()
    report(rep_fd, True, "passed", hmac.new(secret, PASS_MESSAGE, hashlib.sha256).hexdigest())
    return 0


def main(argv: list[str]) -> int:
    in_fd, rep_fd = int(argv[1]), int(argv[2])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 0, before the secret is read
        report(rep_fd, False, "harness: cannot make itself non-dumpable")
        return 1
    return run(read_input(in_fd), rep_fd)


if __name__ == "__main__":
    try:
        rc = main(sys.argv)
    except BaseException as e:
        try:
            report(int(sys.argv[2]), False, f"harness error: {type(e).__name__}: {e}")
        except BaseException:
            pass
        rc = 1
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except BaseException:
            pass
    os._exit(rc)
