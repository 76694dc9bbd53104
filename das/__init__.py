"""das: a lossless speculative-decoding drafter for RL rollouts (per-problem suffix trees).

* :class:`SuffixTree`: depth-bounded weighted suffix trie with frequency-based drafts.
* :class:`DASDrafter`: per-problem, windowed, version-weighted drafter (start / add / speculate / stop),
  per row or for all rows of an engine step at once (:class:`DraftBatch`).
* :class:`DASConfig`: the drafter and speculation-budget settings, their defaults and ranges (:mod:`das.config`).
"""

from das import numba_cache

numba_cache.install()  # before the kernel modules' first @njit(cache=True): their caches expire together

from das.config import DASConfig  # noqa: E402
from das.draft import Draft, DraftBatch, empty_draft  # noqa: E402
from das.drafter import DASDrafter  # noqa: E402
from das.problem_store import problem_id  # noqa: E402
from das.suffix_tree import SuffixTree  # noqa: E402

__all__ = ["DASConfig", "DASDrafter", "Draft", "DraftBatch", "SuffixTree", "empty_draft", "problem_id"]
