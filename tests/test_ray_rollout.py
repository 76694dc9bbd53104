"""Ray data-parallel rollouts: N=2 local CPU workers, and recovery from a worker killed mid-iteration."""

import importlib.util

import pytest

from integrations.rl.ray_rollout import Group, RayRolloutDriver

# each Ray worker builds a vLLM engine; Ray is imported in the tests, not at collection
pytestmark = [pytest.mark.engine, pytest.mark.skipif(None in (importlib.util.find_spec("ray"), importlib.util.find_spec("vllm")),
                                                     reason="needs ray and vLLM")]


@pytest.fixture(scope="module")
def driver(tiny_model):
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    drv = RayRolloutDriver(tiny_model, "das", num_workers=2, max_tokens=12, temperature=0.0,
                           engine_kwargs={"dtype": "float32", "max_model_len": 128, "das_config": {"budget": "fixed"}})  # drafts every step
    yield drv
    drv.shutdown()
    ray.shutdown()


def groups(k, n=3):
    return [Group(f"g{i}", f"p{i}", [5 + i, 17, 42, 8 + i], n) for i in range(k)]


def test_two_workers_generate_every_rollout_and_keep_groups_whole(driver):
    gs = groups(6, n=1)  # greedy needs n = 1 in vLLM
    first = driver.run_iteration(gs, policy_version=1, sampling={"ignore_eos": True})
    assert set(first) == {g.group_id for g in gs}
    assert all(len(first[g.group_id]) == g.n and all(len(s) == 12 for s in first[g.group_id]) for g in gs)
    second = driver.run_iteration(gs, policy_version=2, sampling={"ignore_eos": True})
    assert second == first  # greedy: same policy, same rollouts, whichever worker ran them


def test_a_worker_killed_mid_iteration_loses_no_rollout(driver):
    import ray

    gs = groups(6)
    killed = []

    def kill_worker_zero(drv, assignment):
        ray.kill(drv.workers[0])
        killed.append(int((assignment == 0).sum()))

    before = driver.redispatched_groups
    pulled = driver.last_iteration["engines"][1]["history"]["pulled"]
    sampling = {"temperature": 0.8, "ignore_eos": True}
    out = driver.run_iteration(gs, policy_version=3, sampling=sampling, on_dispatch=kill_worker_zero)
    assert killed and killed[0] > 0
    assert driver.redispatched_groups - before == killed[0]
    # the survivor drafted the dead worker's groups from their history: the one rollout of each in versions 1 and 2
    assert driver.last_iteration["engines"][1]["history"]["pulled"] - pulled == 2 * killed[0]
    assert set(out) == {g.group_id for g in gs}
    assert all(len(out[g.group_id]) == g.n and all(len(s) == 12 for s in out[g.group_id]) for g in gs)
    # The next iteration replaces the dead worker and runs on two workers again.
    again = driver.run_iteration(gs, policy_version=4, sampling=sampling)
    assert driver.replaced_workers >= 1 and all(driver.alive) and set(again) == set(out)


def test_a_problem_moved_to_another_engine_drafts_there_from_its_earlier_rollouts(driver):
    # Round robin puts q0 on engine 0 and q1 on engine 1 in version 5, and swaps them in version 6:
    # each engine then serves a problem it never generated, and (greedy: the same rollouts again)
    # drafts them from the other engine's rollouts, pulled from the shared history before its first draft.
    driver.placement = "round_robin"
    try:
        a = [Group("a0", "q0", [9, 3, 5, 7], 1), Group("a1", "q1", [11, 2, 6, 4], 1)]
        b = [Group("b1", "q1", [11, 2, 6, 4], 1), Group("b0", "q0", [9, 3, 5, 7], 1)]
        first = driver.run_iteration(a, policy_version=5, sampling={"ignore_eos": True})
        r1 = driver.last_iteration
        second = driver.run_iteration(b, policy_version=6, sampling={"ignore_eos": True})
        r2 = driver.last_iteration
    finally:
        driver.placement = "lpt"
    assert second["b0"] == first["a0"] and second["b1"] == first["a1"]
    assert r1["placement"]["groups_per_engine"] == r2["placement"]["groups_per_engine"] == [1, 1]
    for e in range(2):
        before, after = r1["engines"][e], r2["engines"][e]
        assert after["history"]["pulled"] - before["history"]["pulled"] == 1  # the other engine's one rollout of its new problem
        assert after["accepted_tokens"] > before["accepted_tokens"]  # drafted from it: accepted more than with its own output only
        assert after["acceptance_length"] > 2.0
    assert ray_history_rollouts(driver) >= 4


def ray_history_rollouts(driver):
    import ray

    return ray.get(driver.history.info.remote())["rollouts"]
