"""Untrusted Python run against trusted tests, in a bubblewrap sandbox, with a pass it cannot forge.

:func:`run_tests` checks a solution against a problem's tests; :func:`run_program` runs a whole
program. What runs inside the sandbox is the package :mod:`integrations.rl.sandbox`; this module
sets the sandbox up, feeds the harness and reads its verdict. The pass cannot be forged: the
tests run in the harness (*T*), never in the solution's process (*U*), and reach the solution
only through plain data; T reports on a pipe U does not inherit, authenticated with an HMAC of a
per-run secret, and is non-dumpable (:mod:`integrations.rl.sandbox.harness_launcher`). A response
passes only with that report *and* exit status 0, in time. Both run in a sandbox (default
``sandbox="bwrap"``, bubblewrap):

* own PID, network, IPC, UTS and mount namespaces: the root file system is a fresh read-only
  tmpfs holding read-only binds of ``/usr`` (``/bin``, ``/lib*``, ``/sbin``), the Python
  installation and virtual environment, ``/etc``'s loader files, ``passwd``, ``group`` and
  ``localtime``, and the harness's own package at :data:`PACKAGE_INSIDE`; nothing else of the
  host (no ``/home``, ``/root``, rest of the project, ``/sys``, ``/run``). The only writable places
  are a private ``/tmp`` (the working directory) of ``max(64 MiB, 4 x max_file_mb)`` and a
  ``/dev/shm`` of a quarter of that; ``/proc`` shows only the sandbox's processes, ``/dev`` only
  null, zero, full, random, urandom, tty and a new pts. Both interpreters run ``python -I``;
* an unprivileged uid with no capabilities and ``no_new_privs``: when the trainer runs as root,
  ``setpriv`` drops to a uid of its own per run (``2000000000 + r``, no passwd entry); otherwise
  bubblewrap's user namespace maps the caller's own uid, with every capability dropped;
* resource limits set before any untrusted code runs: address space (``memory_mb``), CPU seconds,
  file size (``max_file_mb``), open files, processes (``max_procs``, RLIMIT_NPROC), no core dumps;
* a wall-clock ``timeout_s``: at the limit the whole sandbox is killed (bubblewrap's process group;
  the PID namespace takes every descendant with it, ``setsid`` or not), and nothing waits for the
  child's pipes to close. When the harness exits, the namespace's other processes die with it.
  stderr is read with a cap (its last :data:`STDERR_CAP` bytes); stdout goes to ``/dev/null``;
* fail closed: the network is reachable only with ``network="allow"``; if the sandbox cannot be
  set up (bubblewrap missing, or user namespaces disabled for a non-root caller),
  :class:`SandboxUnavailable` says how to fix it (:func:`check_sandbox` asks before a run).
  ``sandbox="none"`` (which also needs ``network="allow"``) runs the same harness with resource
  limits and a process group only: for trusted code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from integrations.rl import sandbox as inside
from integrations.rl.sandbox.harness_launcher import PASS_MESSAGE, REPORT_CAP

__all__ = ["CodeResult", "SandboxUnavailable", "NETWORK_MODES", "SANDBOX_MODES", "STDERR_CAP", "check_sandbox",
           "forget_probes", "run_program", "run_tests"]

#: Bytes of the child's stderr kept (its tail); the rest is read and discarded.
STDERR_CAP = 64 << 10
NETWORK_MODES = ("isolate", "require", "allow")  # "require" is the same as "isolate" (kept for old recipes)
SANDBOX_MODES = ("bwrap", "none")


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



_PROBE_LOCK = threading.Lock()
_PROBED: dict[tuple, tuple[list[str] | None, str]] = {}
_UID_BASE = 2_000_000_000
#: Where the harness's package is bound inside the sandbox (the module path under the sandbox's root).
PACKAGE_INSIDE = inside.SANDBOX_ROOT + "/" + inside.__name__.replace(".", "/")


def forget_probes() -> None:
    """Forget which sandbox settings worked here: the next run probes again (after bubblewrap was
    installed, or user namespaces enabled, while this process ran)."""
    with _PROBE_LOCK:
        _PROBED.clear()



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
    parents(PACKAGE_INSIDE)  # the harness's package, alone, read-only: what the interpreters run
    args.extend(["--ro-bind", os.path.dirname(os.path.abspath(inside.__file__)), PACKAGE_INSIDE])
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
                probe = inside.command(python, inside.PROBE, root=inside.SANDBOX_ROOT)
                r = subprocess.run([*args, "--", *drop, *probe], capture_output=True,
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
                          "reply_cap": 32 << 20}).encode()
    payload = len(payload).to_bytes(8, "big") + payload
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONHASHSEED": "0", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
    in_r, in_w = os.pipe()
    rep_r, rep_w = os.pipe()
    harness = inside.command(python, inside.HARNESS, str(in_r), str(rep_w), root=inside.ROOT if prefix is None else inside.SANDBOX_ROOT)
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
                elif len(report) < REPORT_CAP:
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
            want = hmac.new(secret, PASS_MESSAGE, hashlib.sha256).hexdigest()
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
