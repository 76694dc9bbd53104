"""Ray driver faults without vLLM: a stand-in worker (same methods as RolloutWorker) on real Ray.

A worker lost between iterations is replaced; a hung (SIGSTOPped) worker's groups are
re-dispatched after the task deadline; a batch that keeps getting lost ends in a clear error.
With the shared history (a real history actor; the stand-in's drafter is a dict): a worker killed
mid-iteration has its groups finish elsewhere drafting from the full history, and a restarted
history actor is refilled by the engines, which draft from what they hold meanwhile.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

ray = pytest.importorskip("ray")

from integrations.rl.ray_rollout import Group, RayRolloutDriver  # noqa: E402

slow = pytest.mark.slow  # a local Ray cluster, worker processes and timeouts: seconds per test


class EchoWorker:
    """Deterministic 'rollouts': sample j of a group is [prompt[0], j, version] * 3, after a short pause."""

    def __init__(self, model, method, engine_kwargs):
        self.version = 0
        self.delay = float(engine_kwargs.get("delay", 0.3))
        self.stall = set(engine_kwargs.get("stall", ()))

    def begin_iteration(self, policy_version):
        self.version = policy_version

    def generate(self, groups, sampling, seed):
        time.sleep(self.delay)
        if any(g.group_id in self.stall for g in groups):
            time.sleep(3600)
        return {g.group_id: [[g.prompt_ids[0], j, self.version] * 3 for j in range(g.n)] for g in groups}

    def pid(self):
        return os.getpid()


class HistoryWorker(EchoWorker):
    """A stand-in with the shared history: a real HistoryClient whose drafter is a dict.

    Sample j of a group is ``[prompt[0], j, version, h]``, ``h`` the rollouts of the problem its
    drafter held (from any engine) when the batch started.
    """

    def __init__(self, model, method, engine_kwargs, history=None, evict_after=2):
        super().__init__(model, method, engine_kwargs)
        from integrations.rl.history import NAMESPACE, HistoryClient

        self.held = {}
        self.client = HistoryClient(lambda: ray.get_actor(history, namespace=NAMESPACE), self._ingest, self._evict, evict_after=evict_after,
                                    timeout_s=5)

    def _ingest(self, rollouts):
        for pid, _, out, _v in rollouts:
            self.held.setdefault(pid, []).append(tuple(out))

    def _evict(self, pids):
        for p in pids:
            self.held.pop(p, None)

    def begin_iteration(self, policy_version):
        super().begin_iteration(policy_version)
        self.client.begin_iteration(policy_version)

    def generate(self, groups, sampling, seed):
        self.client.before_generate([(g.problem_id, g.prompt_ids) for g in groups])
        time.sleep(self.delay)
        out = {g.group_id: [[g.prompt_ids[0], j, self.version, len(self.held.get(g.problem_id, ()))] for j in range(g.n)] for g in groups}
        rollouts = [(g.problem_id, g.prompt_ids, o, self.version) for g in groups for o in out[g.group_id]]
        self._ingest(rollouts)
        self.client.after_generate(rollouts)
        return out


@pytest.fixture(scope="module")
def ray_session():
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import the tests
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def groups(k, n=2):
    return [Group(f"g{i}", f"p{i}", [100 + i, 1, 2], n) for i in range(k)]


def expected(gs, version):
    return {g.group_id: [[g.prompt_ids[0], j, version] * 3 for j in range(g.n)] for g in gs}


def make_driver(**kw):
    engine = kw.pop("engine_kwargs", {})
    cls = kw.pop("worker_cls", EchoWorker)
    return RayRolloutDriver("unused", "das" if cls is HistoryWorker else "none", kw.pop("num_workers", 2), worker_cls=cls,
                            engine_kwargs=engine, num_cpus_per_worker=0.5, **kw)


@slow
def test_a_worker_killed_mid_iteration_has_its_groups_finish_elsewhere_from_the_full_history(ray_session):
    drv = make_driver(worker_cls=HistoryWorker, task_timeout_s=30, engine_kwargs={"delay": 1.0}, placement="round_robin")
    try:
        gs = groups(4)
        first = drv.run_iteration(gs, policy_version=1)
        assert {s[3] for out in first.values() for s in out} == {0}  # nothing before the first iteration
        killed = []

        def kill_worker_zero(d, assignment):
            ray.kill(d.workers[0])
            killed.extend(int(i) for i in (assignment == 0).nonzero()[0])

        second = drv.run_iteration(gs, policy_version=2, on_dispatch=kill_worker_zero)
        assert killed and drv.redispatched_groups == len(killed)
        # round robin put g_i on worker i % 2 in both iterations: the killed worker's groups now ran on
        # worker 1, which never served them, and drafted from both version-1 rollouts of their problem
        assert all(s[:3] == [gs[i].prompt_ids[0], j, 2] and s[3] == 2 for i in killed for j, s in enumerate(second[gs[i].group_id]))
        third = drv.run_iteration(gs, policy_version=3)  # a replacement worker starts empty and pulls every problem it gets
        assert all(s[3] == 4 for out in third.values() for s in out) and drv.replaced_workers == 1
    finally:
        drv.shutdown()


@slow
def test_a_restarted_history_actor_is_refilled_by_the_engines(ray_session):
    drv = make_driver(worker_cls=HistoryWorker, task_timeout_s=30, engine_kwargs={"delay": 0.2}, placement="round_robin")
    try:
        gs = groups(4)
        drv.run_iteration(gs, policy_version=1)
        before = ray.get(drv.history.info.remote())
        os.kill(before["pid"], signal.SIGKILL)  # its process dies; Ray starts it again, empty
        deadline = time.monotonic() + 60
        while True:
            try:
                info = ray.get(drv.history.info.remote(), timeout=5)
                if info["epoch"] != before["epoch"]:
                    break
            except Exception:  # restarting
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert info["rollouts"] == 0
        # the groups swap engines: each engine drafts from what it holds, sees the new epoch, re-publishes and re-syncs
        swapped = [Group(f"s{i}", f"p{(i + 1) % 4}", [100 + (i + 1) % 4, 1, 2], 2) for i in range(4)]
        drv.run_iteration(swapped, policy_version=2)
        third = drv.run_iteration(gs, policy_version=3)
        after = ray.get(drv.history.info.remote())
        assert after["rollouts"] == before["rollouts"] * 3  # versions 1, 2 and 3: nothing lost
        assert all(s[3] == 4 for out in third.values() for s in out)  # each problem's versions 1 and 2 on whichever engine
    finally:
        drv.shutdown()


@slow
def test_a_worker_lost_between_iterations_is_replaced(ray_session):
    drv = make_driver(task_timeout_s=30, start_timeout_s=30)
    try:
        gs = groups(4)
        assert drv.run_iteration(gs, policy_version=1) == expected(gs, 1)
        ray.kill(drv.workers[0])  # dies while nobody is looking
        time.sleep(0.5)
        assert drv.run_iteration(gs, policy_version=2) == expected(gs, 2)
        assert drv.replaced_workers == 1 and all(drv.alive)
    finally:
        drv.shutdown()


@slow
def test_a_worker_hung_between_iterations_is_replaced(ray_session):
    drv = make_driver(task_timeout_s=30, begin_timeout_s=3)
    try:
        gs = groups(4)
        drv.run_iteration(gs, policy_version=1)
        os.kill(ray.get(drv.workers[1].pid.remote()), signal.SIGSTOP)
        t0 = time.monotonic()
        assert drv.run_iteration(gs, policy_version=2) == expected(gs, 2)
        assert drv.replaced_workers == 1 and drv.hung_workers == 1 and time.monotonic() - t0 < 20
    finally:
        drv.shutdown()


@slow
def test_a_hung_worker_mid_iteration_has_its_groups_redispatched(ray_session):
    drv = make_driver(task_timeout_s=2, engine_kwargs={"delay": 1.0})
    try:
        gs = groups(6)
        stopped = []
        pid0 = ray.get(drv.workers[0].pid.remote())  # asked now: mid-iteration it would queue behind generate

        def stop_worker_zero(d, assignment):
            os.kill(pid0, signal.SIGSTOP)
            stopped.append(int((assignment == 0).sum()))

        t0 = time.monotonic()
        out = drv.run_iteration(gs, policy_version=3, on_dispatch=stop_worker_zero)
        assert out == expected(gs, 3)
        assert stopped[0] > 0 and drv.redispatched_groups == stopped[0] and drv.hung_workers == 1
        assert time.monotonic() - t0 < 20
        again = drv.run_iteration(gs, policy_version=4)  # the hung worker was replaced
        assert again == expected(gs, 4) and drv.replaced_workers >= 1 and all(drv.alive)
    finally:
        drv.shutdown()


@slow
def test_a_batch_that_keeps_hanging_ends_in_a_clear_error(ray_session):
    drv = make_driver(task_timeout_s=1, max_redispatch=1, engine_kwargs={"delay": 0.0, "stall": ["g0"]})
    try:
        with pytest.raises(RuntimeError, match="g0.*max_redispatch=1"):
            drv.run_iteration(groups(2), policy_version=1)
    finally:
        drv.shutdown()


def test_bad_driver_settings_are_refused():  # checked before Ray starts: no cluster needed
    for kw in ({"task_timeout_s": 0}, {"start_timeout_s": -1}, {"begin_timeout_s": 0}, {"max_redispatch": -1}, {"num_workers": 0}):
        with pytest.raises(ValueError):
            make_driver(**kw)
