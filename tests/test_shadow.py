"""benchmarks.shadow: every drafter asked at the lead's steps, counted against the trace."""

from __future__ import annotations

import json

import pytest

from benchmarks import shadow
from benchmarks.replay import load_trace, replay


@pytest.fixture
def named(oracle_drafter):
    """Oracle drafters with a name: ``named(iterations, k, name)``, and ``named.wrong(...)``, whose
    first draft token is changed (never accepted)."""

    class Named(oracle_drafter):
        def __init__(self, iterations, k, name):
            super().__init__(iterations, k)
            self.name = name

    class Wrong(Named):
        def propose(self, rid, ctx):
            d = list(super().propose(rid, ctx))
            return [d[0] + 1000] + d[1:] if d else d

    Named.wrong = Wrong
    return Named


def test_shadows_are_counted_at_the_lead_steps(synthetic_trace, oracle_drafter, named):
    its = load_trace(synthetic_trace())
    lead = named(its, 2, "lead")
    alone = replay(oracle_drafter(its, 2), its)
    s = shadow.Shadowed(its, lead, [named(its, 4, "longer"), named.wrong(its, 2, "wrong")])
    res = replay(s, its)
    assert res["verification_steps"] == alone["verification_steps"]  # the lead alone decides the steps
    c = s.counts
    steps = res["verification_steps"] - sum(len(rs) for rs in its)  # minus the prefill steps (no draft asked)
    assert c["lead"][0] == c["longer"][0] == c["wrong"][0] == steps
    assert c["lead"][2] == c["lead"][3] == res["drafted_tokens"]
    # the replay counts no bonus token after a draft that reaches the rollout's end: one fewer there
    assert 0 < c["lead"][3] - res["accepted_tokens"] <= sum(len(rs) for rs in its)
    # the longer oracle is asked at the same contexts: all its tokens within the rollout are accepted
    assert c["longer"][3] == c["longer"][2] > c["lead"][3]
    assert c["wrong"][3] == 0 and c["wrong"][2] == c["lead"][2]


def test_shadow_names_must_differ(synthetic_trace, named):
    its = load_trace(synthetic_trace())
    with pytest.raises(ValueError, match="distinct"):
        shadow.Shadowed(its, named(its, 2, "a"), [named(its, 2, "a")])


def test_main_writes_the_report(tmp_path, capsys, synthetic_trace):
    path = synthetic_trace()
    out = tmp_path / "s.json"
    assert shadow.main(["--trace", str(path), "--lead", "ngram", "--shadows", "das", "--k", "4", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert set(rep["drafters"]) == {"ngram", "das"}
    assert rep["drafters"]["ngram"]["drafted_tokens"] == rep["replay"]["drafted_tokens"]
    assert rep["drafters"]["das"]["steps"] == rep["drafters"]["ngram"]["steps"]
    assert "drafted/acc" in capsys.readouterr().out
    assert shadow.main(["--trace", str(path), "--shadows", ""]) == 2
