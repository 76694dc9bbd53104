"""Multi-engine pieces without engines: CPU lists per engine, pooling per-batch stats, and the user-facing options."""

import pytest

from integrations.rl.ray_rollout import engine_cpus, pool_stats


def test_engines_get_disjoint_cores_and_share_only_when_there_are_more_engines_than_cores():
    assert engine_cpus(2, cores=2) == ["0", "1"]
    assert engine_cpus(2, cores=8) == ["0-3", "4-7"]
    assert engine_cpus(3, cores=2) == ["0", "1", "0"]
    with pytest.raises(ValueError, match="num_workers"):
        engine_cpus(0, cores=2)


def test_pooled_acceptance_is_tokens_over_verification_steps_of_every_engine():
    a = {"tokens": 100, "verification_steps": 50, "draft_tokens": 80, "accepted_tokens": 50, "wall_time_s": 2.0, "tail_s": 0.5,
         "engine": 0, "drafter": {"bytes": 1000, "problems": 2}}
    b = {"tokens": 60, "verification_steps": 40, "draft_tokens": 30, "accepted_tokens": 20, "wall_time_s": 4.0, "tail_s": 1.5,
         "engine": 1, "drafter": {"bytes": 500, "problems": 1}}
    p = pool_stats([a, b])
    assert p["tokens"] == 160 and p["acceptance_length"] == pytest.approx(160 / 90, abs=1e-4)
    assert p["wall_time_s"] == 4.0 and p["tokens_per_s"] == 40.0 and p["tail_s"] == 1.5  # engines run at once: the slowest
    assert p["drafter"] == {"bytes": 1500, "problems": 3}
    later = dict(a, drafter={"bytes": 1200, "problems": 3})
    assert pool_stats([a, later])["drafter"] == {"bytes": 1200, "problems": 3}  # an engine's latest snapshot, not a sum over its batches


def test_the_engine_options_are_checked_before_any_engine_starts():
    from integrations.rl.recipes import load_recipe
    from integrations.rollout import parse_args

    args = parse_args(["--engines", "2", "--placement", "round_robin", "--compare", ""])
    assert (args.engines, args.placement, args.engine_history) == (2, "round_robin", "shared")
    for bad in (["--engines", "0"], ["--placement", "longest"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    assert load_recipe(None, ["rollout.engines=2", "rollout.placement=round_robin"]).validate().rollout.engines == 2
    for bad in ("rollout.engines=0", "rollout.placement=longest"):
        with pytest.raises(ValueError, match="rollout\\.(engines|placement)"):
            load_recipe(None, [bad]).validate()
