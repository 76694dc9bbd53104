"""The solution's process (U): resource limits first, then the prelude and the solution, then it
serves the harness's calls.

``python -I -m integrations.rl.sandbox.solution_launcher RFD WFD MEMORY CPU FSIZE NOFILE NPROC``
(started by :mod:`.harness_launcher`, through :func:`integrations.rl.sandbox.command`): reads one
JSON line from fd ``RFD`` (``mode``, ``prelude``, ``code``, ``data_classes``) and answers on fd
``WFD``. Limits (bytes, seconds, counts; 0 memory: none) are set before any untrusted code runs.

Nothing here is trusted: the harness only ever reads plain data from this process
(:mod:`.codec`). In ``"program"`` mode the code runs as a whole program and the process exits with
its status; in ``"tests"`` mode the module runs once, then every request is one of
``{"op": "globals", "names": [...]}`` (the solution's own globals of those names),
``{"op": "getattr", "h": handle, "name": ...}`` and ``{"op": "call", "h": handle, "a": args, "k": kwargs}``,
each answered with ``{"ok": value}`` or ``{"err": why, "exit": whether it ended the process}``.
"""

from __future__ import annotations

import builtins
import json
import os
import resource
import sys
from typing import Any

from .codec import CodecError, decode, encode


def set_limits(memory: int, cpu: int, fsize: int, nofile: int, nproc: int) -> None:
    """Address space and data (``memory`` bytes, 0: none), CPU seconds, file size, open files,
    processes; no core dumps."""
    for lim in (resource.RLIMIT_AS, resource.RLIMIT_DATA):
        if memory > 0:
            resource.setrlimit(lim, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def main(argv: list[str]) -> None:
    rfd, wfd = int(argv[1]), int(argv[2])
    set_limits(*(int(x) for x in argv[3:8]))
    rf = os.fdopen(rfd, "rb")
    wf = os.fdopen(wfd, "wb")
    init = json.loads(rf.readline())
    ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    sys.argv = ["solution.py"]
    if init["mode"] == "program":
        rf.close()
        wf.close()
        exec(compile(init["code"], "program.py", "exec"), ns)
        sys.exit(0)

    def send(obj: Any) -> None:
        wf.write(json.dumps(obj, separators=(",", ":")).encode() + b"\n")
        wf.flush()

    try:
        exec(compile(init["prelude"], "<prelude>", "exec"), ns)
        pre = dict(ns)
        exec(compile(init["code"], "<solution>", "exec"), ns)
    except BaseException as e:
        import traceback

        traceback.print_exc()
        send({"err": "the solution raised " + _why(e), "exit": isinstance(e, (SystemExit, KeyboardInterrupt))})
        os._exit(1)
    handles: dict[int, Any] = {}
    data_names = frozenset(init["data_classes"])

    def to_handle(v: Any) -> int:
        handles[len(handles)] = v
        return len(handles) - 1

    def data_name(v: Any) -> str | None:
        n = type(v).__name__
        return n if n in data_names and hasattr(v, "__dict__") else None

    def make_obj(name: str) -> Any:
        cls = ns.get(name)
        if not isinstance(cls, type):
            raise CodecError(f"the solution has no class {name}")
        return cls.__new__(cls)

    def get_handle(i: int) -> Any:
        if i not in handles:
            raise CodecError("unknown handle")
        return handles[i]

    def out(v: Any) -> dict:
        return encode(v, data_name, to_handle, False)

    def into(m: Any) -> Any:
        return decode(m, make_obj, setattr, get_handle)

    send({"ok": None})
    for line in rf:
        try:
            req = json.loads(line)
            op = req["op"]
            if op == "globals":
                reply = out({n: ns[n] for n in req["names"] if n in ns and ns[n] is not pre.get(n, pre)})
            elif op == "getattr":
                reply = out(getattr(get_handle(req["h"]), req["name"]))
            elif op == "call":
                reply = out(get_handle(req["h"])(*into(req["a"]), **into(req["k"])))
            else:
                raise CodecError(f"unknown request {op!r}")
            send({"ok": reply})
        except BaseException as e:
            send({"err": _why(e), "exit": isinstance(e, (SystemExit, KeyboardInterrupt))})


if __name__ == "__main__":
    main(sys.argv)
