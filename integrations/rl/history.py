"""One rollout history for every rollout engine: a Ray actor, and each engine's client of it.

Each engine's DAS drafter drafts from the finished rollouts of the problem it is generating
(:class:`das.drafter.DASDrafter`). With several engines (data-parallel replicas), a problem's
rollouts are generated wherever its GRPO group was placed, so an engine that receives a problem
for the first time (or after another engine served it) lacks its history. The finished rollouts of
every problem (token ids, policy version; the length is the output's) therefore live in one place,
a Ray actor (:class:`HistoryStore` wrapped by :func:`history_actor`, named, restarted by Ray when
its process dies), and every engine's :class:`HistoryClient`:

- publishes the rollouts its engine generated as soon as a batch of groups finishes (so losing an
  engine later loses none of them);
- before its engine drafts for a problem, pulls that problem's rollouts it does not hold yet
  (within the drafter's window) and hands them to the drafter
  (:meth:`das.drafter.DASDrafter.add_rollout`, through the worker extension
  :class:`integrations.vllm_ext.history_ext.HistoryExtension`);
- evicts from its drafter the problems it has not served for ``evict_after`` policy versions, so
  an engine's drafter memory follows the problems it serves, not the run.

Each rollout has a unique id (``origin:n``: the publishing client and a counter) and a sequence
number in the store. A client pulls by sequence number (``since``) while the store keeps its
identity (``epoch``); when the store was restarted (a new epoch, empty), the client keeps
drafting from what its drafter holds, re-publishes its own rollouts of the window (its
``own`` log, bounded like its drafter) and pulls the rest again by id, so nothing is ingested twice.
Reads and writes that fail (the actor restarting) are logged and skipped: drafting never waits on them.

The design follows the shared rollout stores of HistoSpec/RhymeRL (a distributed suffix-tree draft
server) and of DAS on verl (a Ray actor holding the trajectories, deltas pushed to every engine); the
DAS paper (Sec. 4) keeps a per-problem history within a window of policy versions.
"""

from __future__ import annotations

import itertools
import logging
import os
import uuid
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

#: the Ray name of the history actor (and its namespace) unless the caller names another.
DEFAULT_NAME = "das_history"
NAMESPACE = "das"

# One rollout as it travels: (problem id, prompt token ids, output token ids, policy version).
Rollout = tuple[Hashable, Sequence[int], Sequence[int], int]


def _check_int(value: Any, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


class HistoryStore:
    """The finished rollouts of every problem, within a window of policy versions (the Ray actor's body).

    A problem keeps the rollouts of policy versions ``>= version - window + 1`` and those of its
    own last ``keep_visits`` visits (the versions in which it got rollouts), as
    :class:`das.problem_store.ProblemStore` keeps them; older ones are dropped at
    :meth:`begin_iteration`. A problem's prompt is stored once.

    Args:
        window: int >= 1, policy versions kept (the drafters' ``window``).
        keep_visits: int >= 0, a problem's last visits kept however old (the drafters' ``keep_visits``).

    Raises:
        ValueError: a bad ``window`` or ``keep_visits``.
    """

    def __init__(self, window: int = 16, keep_visits: int = 2):
        self.window = _check_int(window, "window", 1)
        self.keep_visits = _check_int(keep_visits, "keep_visits", 0)
        self.epoch = uuid.uuid4().hex  # a restarted actor is a new, empty store
        self.version = 0
        self._seq = itertools.count(1)
        self._prompts: dict[Hashable, list[int]] = {}
        # problem id -> [(seq, uid, policy version, output ids)], in seq order
        self._rows: dict[Hashable, list[tuple[int, str, int, list[int]]]] = {}
        self._uids: set[str] = set()

    def info(self) -> dict[str, Any]:
        """``epoch`` (str), ``version`` (int), ``pid`` (its process) and the totals: ``problems``, ``rollouts``, ``tokens`` (output tokens)."""
        rows = [r for rs in self._rows.values() for r in rs]
        return {"epoch": self.epoch, "version": self.version, "pid": os.getpid(), "problems": len(self._rows), "rollouts": len(rows),
                "tokens": sum(len(r[3]) for r in rows)}

    def add(self, rollouts: Iterable[tuple[str, Rollout]]) -> dict[str, Any]:
        """Store ``(uid, (problem id, prompt ids, output ids, policy version))`` pairs; a uid already stored is skipped.

        Returns:
            ``{"epoch": str, "added": int}``.

        Raises:
            ValueError: a policy version that is not an int >= 0.
        """
        added = 0
        for uid, (pid, prompt, output, version) in rollouts:
            _check_int(version, "policy_version", 0)
            if uid in self._uids:
                continue
            self._uids.add(uid)
            self._prompts.setdefault(pid, [int(t) for t in prompt])
            self._rows.setdefault(pid, []).append((next(self._seq), uid, version, [int(t) for t in output]))
            added += 1
        return {"epoch": self.epoch, "added": added}

    def pull(self, problem_ids: Iterable[Hashable], since: dict[Hashable, int] | None = None, origin: str | None = None) -> dict[str, Any]:
        """The rollouts of ``problem_ids`` stored after sequence number ``since[pid]`` (0: all),
        except those published by ``origin`` (a client's own rollouts, already in its drafter).

        Returns:
            ``{"epoch": str, "rollouts": {pid: [(seq, uid, policy version, output ids)]}, "prompts": {pid: prompt ids}}``
            (only problems with rollouts to send), rollouts in version order.
        """
        since = since or {}
        out, prompts = {}, {}
        for pid in problem_ids:
            rows = [r for r in self._rows.get(pid, ()) if r[0] > since.get(pid, 0) and not (origin and r[1].startswith(origin + ":"))]
            if rows:
                out[pid] = sorted(rows, key=lambda r: (r[2], r[0]))
                prompts[pid] = self._prompts[pid]
        return {"epoch": self.epoch, "rollouts": out, "prompts": prompts}

    def lengths(self, problem_ids: Iterable[Hashable]) -> dict[Hashable, list[tuple[int, int]]]:
        """``{pid: [(policy version, output length)]}`` of the stored rollouts (a length predictor's feed)."""
        return {pid: [(r[2], len(r[3])) for r in self._rows[pid]] for pid in problem_ids if pid in self._rows}

    def begin_iteration(self, policy_version: int) -> dict[str, Any]:
        """Advance to ``policy_version`` (non-decreasing; an older one is ignored) and drop what the window no longer keeps.

        Returns:
            :meth:`info`.
        """
        _check_int(policy_version, "policy_version", 0)
        self.version = max(self.version, policy_version)
        oldest = self.version - self.window + 1
        for pid in list(self._rows):
            rows = self._rows[pid]
            visits = sorted({r[2] for r in rows}, reverse=True)[: self.keep_visits]
            kept = [r for r in rows if r[2] >= oldest or r[2] in visits]
            if len(kept) < len(rows):
                self._uids.difference_update({r[1] for r in rows} - {r[1] for r in kept})
            if kept:
                self._rows[pid] = kept
            else:
                del self._rows[pid], self._prompts[pid]
        return self.info()


def history_actor(name: str = DEFAULT_NAME, *, window: int = 16, keep_visits: int = 2, namespace: str = NAMESPACE):
    """The named history actor: created if it does not exist, else the existing one.

    The actor takes no CPU from the engines (``num_cpus=0``), and Ray restarts it when its process
    dies (``max_restarts=-1``; it then starts empty, with a new epoch, and the engines re-sync).
    Its lifetime is the driver's (``ray.init`` must have run).

    Returns:
        A Ray actor handle of :class:`HistoryStore`.
    """
    import ray

    cls = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(HistoryStore)
    return cls.options(name=name, namespace=namespace, get_if_exists=True).remote(window=window, keep_visits=keep_visits)


class HistoryClient:
    """One engine's view of the shared history (lives beside the engine, in its Ray worker).

    Args:
        store: a :class:`HistoryStore` or a Ray actor handle of one (``.remote`` methods), or a
            callable returning either (looked up again after a failure).
        ingest: called with ``[(problem id, prompt ids, output ids, policy version)]`` to add
            rollouts to the engine's drafter (in version order).
        evict: called with a list of problem ids to drop from the drafter.
        window: the drafter's window (policy versions): the own log keeps this many.
        evict_after: int >= 1, a problem not served in the last ``evict_after`` policy versions is evicted.
        timeout_s: seconds to wait for the actor before going on without it.
    """

    def __init__(self, store: Any, ingest: Callable[[list[Rollout]], Any], evict: Callable[[list[Hashable]], Any], *,
                 window: int = 16, evict_after: int = 2, timeout_s: float = 30.0):
        self._store_ref = store
        self.ingest, self.evict = ingest, evict
        self.window = _check_int(window, "window", 1)
        self.evict_after = _check_int(evict_after, "evict_after", 1)
        self.timeout_s = float(timeout_s)
        self.origin = uuid.uuid4().hex[:12]
        self._n = itertools.count()
        self.epoch: str | None = None
        self.version = 0
        self.since: dict[Hashable, int] = {}  # problem -> last store seq ingested (this epoch)
        self.held: dict[Hashable, set[str]] = {}  # problem -> uids in the drafter
        self.last_served: dict[Hashable, int] = {}
        self.own: list[tuple[str, Rollout]] = []  # this engine's rollouts of the window (re-published after a store restart)
        self.counters = {"pulled": 0, "published": 0, "evicted": 0, "resyncs": 0, "store_errors": 0}

    # -- the store, local or remote
    def _call(self, method: str, *args: Any) -> Any:
        store = self._store_ref() if callable(self._store_ref) and not hasattr(self._store_ref, method) else self._store_ref
        fn = getattr(store, method)
        if hasattr(fn, "remote"):
            import ray

            return ray.get(fn.remote(*args), timeout=self.timeout_s)
        return fn(*args)

    def _try(self, method: str, *args: Any) -> Any | None:
        try:
            return self._call(method, *args)
        except Exception as exc:  # noqa: BLE001 - the engine drafts from what it holds; the next call re-syncs
            self.counters["store_errors"] += 1
            logger.warning("das history: %s failed (%s: %s); drafting from what this engine holds", method, type(exc).__name__, exc)
            return None

    def _seen_epoch(self, epoch: str) -> bool:
        """Record the store's epoch; True when it changed (a restarted store: re-publish the own log)."""
        if self.epoch == epoch:
            return False
        restarted = self.epoch is not None
        self.epoch = epoch
        self.since.clear()
        if restarted:
            self.counters["resyncs"] += 1
            self._try("add", list(self.own))
        return restarted

    # -- the iteration
    def begin_iteration(self, policy_version: int) -> list[Hashable]:
        """Advance to ``policy_version``: trim the own log to the window and evict the problems not
        served in the last ``evict_after`` versions. Returns the evicted problem ids."""
        self.version = _check_int(policy_version, "policy_version", 0)
        self.own = [o for o in self.own if o[1][3] >= policy_version - self.window + 1]
        stale = [p for p, v in self.last_served.items() if v <= policy_version - self.evict_after]
        if stale:
            self.evict(stale)
            for p in stale:
                self.last_served.pop(p)
                self.held.pop(p, None)
                self.since.pop(p, None)
            self.counters["evicted"] += len(stale)
        return stale

    def before_generate(self, problems: Iterable[tuple[Hashable, Sequence[int]]]) -> int:
        """Bring the drafter up to date on ``(problem id, prompt ids)`` before they are generated.

        Pulls each problem's rollouts the drafter does not hold and ingests them (oldest policy
        version first). Returns the number of rollouts ingested (0 when the store is unreachable).
        """
        pids = []
        for pid, _ in problems:
            self.last_served[pid] = self.version
            if pid not in pids:
                pids.append(pid)
        got = self._try("pull", pids, dict(self.since))
        if got is None:
            return 0
        if self._seen_epoch(got["epoch"]):
            got = self._try("pull", pids, {}) or {"rollouts": {}, "prompts": {}}
        batch: list[Rollout] = []
        for pid, rows in got["rollouts"].items():
            held = self.held.setdefault(pid, set())
            for seq, uid, version, output in rows:
                self.since[pid] = max(self.since.get(pid, 0), seq)
                if uid not in held:
                    held.add(uid)
                    batch.append((pid, got["prompts"][pid], output, version))
        if batch:
            batch.sort(key=lambda r: r[3])
            self.ingest(batch)
            self.counters["pulled"] += len(batch)
        return len(batch)

    def after_generate(self, rollouts: Sequence[Rollout]) -> None:
        """Publish this engine's finished rollouts (already in its drafter: they are marked held)."""
        tagged = []
        for r in rollouts:
            uid = f"{self.origin}:{next(self._n)}"
            self.held.setdefault(r[0], set()).add(uid)
            tagged.append((uid, (r[0], list(r[1]), list(r[2]), int(r[3]))))
        self.own.extend(tagged)
        got = self._try("add", tagged)
        if got is not None:
            self._seen_epoch(got["epoch"])
            self.counters["published"] += len(tagged)
