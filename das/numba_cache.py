"""numba's on-disk cache of das's kernels, invalidated when any kernel module changes.

numba stamps a cached function with the modification time and size of the file that defines it,
and nothing else. das's kernels inline helpers across modules (``inline="always"``: the trie's
node and hash helpers from :mod:`das.trie_kernels` are compiled into :mod:`das.step_threads`,
:mod:`das.mix_kernels` and the replay's drafters), so after a change to one module alone (an
edit, a ``git pull``) the others' cached code still runs the old helpers. After a change of the
node layout that is wrong drafts or a lookup that never ends. Here every function defined in a
kernel module, or in a file registered with :func:`register`, is stamped with its own file and
all of :data:`KERNEL_FILES`: a change to any of them recompiles them all, once.

This uses numba's cache-locator classes (``numba.core.caching``, not a public API): where they
are missing, :func:`install` leaves numba's own behaviour in place.
"""

from __future__ import annotations

import os

_DIR = os.path.dirname(os.path.abspath(__file__))
KERNEL_FILES = tuple(os.path.join(_DIR, name) for name in ("trie_kernels.py", "step_threads.py", "mix_kernels.py"))
_covered = set(KERNEL_FILES)


def register(py_file: str) -> None:
    """Stamp the numba functions that ``py_file`` defines from now on with the kernel modules too
    (for a module outside ``das/`` that inlines their helpers). Call it before its first
    ``@njit(cache=True)``."""
    _covered.add(os.path.abspath(py_file))


def kernel_stamp() -> tuple[tuple[float, int], ...]:
    """``(mtime, size)`` of each of :data:`KERNEL_FILES`."""
    out = []
    for path in KERNEL_FILES:
        st = os.stat(path)
        out.append((st.st_mtime, st.st_size))
    return tuple(out)


def _locator(base):
    class KernelSetLocator(base):
        """numba's ``base`` locator for a covered file, with the kernel modules in its stamp."""

        def get_source_stamp(self):
            return super().get_source_stamp(), kernel_stamp()

        @classmethod
        def from_function(cls, py_func, py_file):
            if os.path.abspath(py_file) not in _covered:
                return None
            return super().from_function(py_func, py_file)

    KernelSetLocator.__name__ = KernelSetLocator.__qualname__ = f"KernelSet{base.__name__}"
    return KernelSetLocator


def install() -> bool:
    """Put the kernel-set locators before numba's own (the same order: a user's
    ``NUMBA_CACHE_DIR``, then ``__pycache__`` beside the source, then the user-wide cache
    directory). Idempotent; returns False where numba lacks the classes this builds on."""
    try:
        from numba.core import caching

        impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # ``_CacheImpl`` in older numba
        classes = impl._locator_classes
        bases = (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator, caching.UserWideCacheLocator)
    except (ImportError, AttributeError):
        return False
    if any(getattr(c, "_das_kernel_set", False) for c in classes):
        return True
    ours = []
    for base in bases:
        cls = _locator(base)
        cls._das_kernel_set = True
        ours.append(cls)
    classes[:0] = ours
    return True
