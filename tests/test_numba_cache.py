"""numba's cached kernels expire together when any kernel module changes (das/numba_cache.py)."""

from __future__ import annotations

import os

from numba.core.dispatcher import Dispatcher

from das import mix_kernels, numba_cache, step_threads, trie_kernels


def _stand_in_kernel_files(tmp_path, monkeypatch):
    files = []
    for name in ("trie_kernels.py", "step_threads.py", "mix_kernels.py"):
        path = tmp_path / name
        path.write_text("# stand-in\n")
        os.utime(path, (1_000_000, 1_000_000))
        files.append(str(path))
    monkeypatch.setattr(numba_cache, "KERNEL_FILES", tuple(files))
    return files


def test_a_change_to_the_trie_kernels_expires_the_cached_mix_and_step_kernels(tmp_path, monkeypatch):
    # numba alone stamps a cached function with its own file only: mix_kernels' cache would keep
    # the trie helpers it inlined before trie_kernels.py changed
    trie, _, _ = _stand_in_kernel_files(tmp_path, monkeypatch)
    locators = [mix_kernels.mix_batch._cache._impl.locator, step_threads.insert_batch_parallel._cache._impl.locator]
    before = [loc.get_source_stamp() for loc in locators]
    os.utime(trie, (2_000_000, 2_000_000))
    after = [loc.get_source_stamp() for loc in locators]
    assert all(a != b for a, b in zip(after, before))
    # and a kernel's own file still counts, as in numba
    assert after[0][0] == (os.stat(mix_kernels.__file__).st_mtime, os.stat(mix_kernels.__file__).st_size)


def test_every_cached_kernel_of_das_uses_the_kernel_set_stamp():
    for module in (trie_kernels, step_threads, mix_kernels):
        kernels = [v for v in vars(module).values() if isinstance(v, Dispatcher) and v._cache._impl is not None
                   and getattr(v, "__module__", "") == module.__name__]
        assert kernels, module.__name__
        for k in kernels:
            assert getattr(type(k._cache._impl.locator), "_das_kernel_set", False), (module.__name__, k.__name__)


def test_install_is_idempotent_and_other_code_keeps_numbas_own_locators():
    from numba.core import caching

    impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl
    n = len(impl._locator_classes)
    assert numba_cache.install()
    assert len(impl._locator_classes) == n
    assert sum(getattr(c, "_das_kernel_set", False) for c in impl._locator_classes) == 3

    def outside():  # a function defined in this test file, which is not registered
        return 1

    for cls in impl._locator_classes:
        if getattr(cls, "_das_kernel_set", False):
            assert cls.from_function(outside, __file__) is None
