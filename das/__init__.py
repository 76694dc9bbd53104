"""das: a lossless speculative-decoding drafter for RL rollouts (per-problem suffix trees).

* :class:`SuffixTree`: depth-bounded weighted suffix trie with frequency-based drafts.
* :class:`DASDrafter`: per-problem, windowed, version-weighted drafter (start / add / speculate / stop),
  per row or for all rows of an engine step at once (:class:`DraftBatch`).
* :class:`DASConfig`: the drafter and speculation-budget settings, their defaults and ranges (:mod:`das.config`).
"""

from das import _numba_cache

_numba_cache.install()  # before the kernel modules' first @njit(cache=True): their caches expire together

from das.config import DASConfig  # noqa: E402
from das.drafter import DASDrafter, DraftBatch, problem_id  # noqa: E402
from das.suffix_tree import Draft, SuffixTree, empty_draft  # noqa: E402

__all__ = ["DASConfig", "DASDrafter", "Draft", "DraftBatch", "SuffixTree", "empty_draft", "problem_id"]
