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
                           engine_kwargs={"dtype": "float32", "max_model_len": 128})
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
    sampling = {"temperature": 0.8, "ignore_eos": True}
    out = driver.run_iteration(gs, policy_version=3, sampling=sampling, on_dispatch=kill_worker_zero)
    assert killed and killed[0] > 0
    assert driver.redispatched_groups - before == killed[0]
    assert set(out) == {g.group_id for g in gs}
    assert all(len(out[g.group_id]) == g.n and all(len(s) == 12 for s in out[g.group_id]) for g in gs)
    # The next iteration replaces the dead worker and runs on two workers again.
    again = driver.run_iteration(gs, policy_version=4, sampling=sampling)
    assert driver.replaced_workers >= 1 and all(driver.alive) and set(again) == set(out)
