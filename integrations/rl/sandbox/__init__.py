"""What runs inside the code sandbox: the value codec, the solution's process and the test harness.

:mod:`integrations.rl.code_sandbox` starts :mod:`.harness_launcher` (the trusted harness, *T*)
inside bubblewrap, and T starts :mod:`.solution_launcher` (the untrusted solution's process, *U*);
the two talk through :mod:`.codec`. Inside the sandbox nothing of the project is visible but this
directory, bound read-only at :data:`SANDBOX_ROOT` ``/integrations/rl/sandbox``: so these modules
import only the standard library and each other.

Both processes run with ``python -I`` (no environment variables, no user site-packages, and
neither the working directory, which the solution can write, nor a script's directory on
``sys.path``). :func:`command` builds their command line: ``python -I -c`` :data:`BOOT`, which puts
the directory holding ``integrations/`` first on ``sys.path`` and runs the module as ``python -m``
would.
"""

from __future__ import annotations

from pathlib import Path

#: Where the directory holding ``integrations/`` is inside the sandbox (only this package is bound under it).
SANDBOX_ROOT = "/das"
#: The directory holding ``integrations/`` where this file is (the project's root outside the sandbox).
ROOT = str(Path(__file__).resolve().parents[3])
#: ``python -I -c BOOT ROOT MODULE ARGS...`` runs MODULE as ``python -I -m MODULE ARGS...`` would, with ROOT first on sys.path.
BOOT = ("import runpy, sys; root, module = sys.argv[1:3]; del sys.argv[1:3]; sys.path.insert(0, root); "
        "runpy.run_module(module, run_name='__main__', alter_sys=True)")

HARNESS = __name__ + ".harness_launcher"
SOLUTION = __name__ + ".solution_launcher"
PROBE = __name__ + ".probe"


def command(python: str, module: str, *args: str, root: str = ROOT) -> list[str]:
    """The command line that runs ``module`` (one of :data:`HARNESS`, :data:`SOLUTION`,
    :data:`PROBE`) with ``args`` under ``python -I``, the package found under ``root``."""
    return [python, "-I", "-c", BOOT, root, module, *args]
