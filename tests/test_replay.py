"""The replay benchmark: step accounting, the n-gram baseline, the report's keys."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.replay import load_trace, main, replay
from benchmarks.replay_drafters import ngram_propose
from integrations.data.trace import Rollout, write_trace


@pytest.mark.parametrize("k", [0, 1, 4])
def test_replay_counts_verification_steps(synthetic_trace, oracle_drafter, k):
    its = load_trace(synthetic_trace())
    res = replay(oracle_drafter(its, k), its)
    lens = [len(r.out_list) for rs in its for r in rs]
    # first token from prefill, then K drafted + 1 bonus token per step
    want = sum(1 + -(-(n - 1) // (k + 1)) for n in lens)
    assert res["verification_steps"] == want and res["tokens"] == sum(lens)
    assert res["acceptance_length"] == pytest.approx(sum(lens) / want, abs=1e-4)
    assert res["accepted_tokens"] == sum(lens) - want
    assert sum(x["verification_steps"] for x in res["iterations"]) == want


def _ngram_brute(tokens, min_n, max_n, k):
    t = list(tokens)
    for n in range(min(max_n, len(t) - 1), min_n - 1, -1):
        for j in range(0, len(t) - n):  # earliest earlier occurrence of the last n tokens
            if t[j : j + n] == t[len(t) - n :]:
                return t[j + n : j + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 2), max_size=29), k=st.sampled_from([1, 4]))
def test_ngram_is_vllm_prompt_lookup(tokens, k):
    """vLLM's n-gram prompt lookup (KMP over the reversed context) drafts what a brute-force search
    for the longest, then earliest, earlier occurrence of a suffix n-gram (2 <= n <= 4) finds."""
    toks = np.array(tokens, np.int32)
    assert ngram_propose(toks, 2, 4, k).tolist() == _ngram_brute(toks, 2, 4, k)


@pytest.mark.slow  # the whole CLI: three drafters, grid, hindsight bound, memory, plot
def test_main_writes_the_report(tmp_path, synthetic_trace):
    pytest.importorskip("arctic_inference.suffix_decoding")
    trace = synthetic_trace()
    out = tmp_path / "r.json"
    assert main(["--trace", str(trace), "--json", str(out), "--grid-k", "4", "--grid-window", "1", "--repeats", "1",
                 "--no-frontier"]) == 0
    rep = json.loads(out.read_text())
    for name in ("das", "arctic_suffix", "ngram"):
        e = rep["drafters"][name]
        for key in ("acceptance_length", "propose_us_p50", "propose_us_p99", "insert_ns_per_token", "bytes_per_token"):
            assert isinstance(e[key], (int, float)), (name, key)
        assert e["acceptance_length"] >= 1.0 and len(e["iterations"]) == 2
    assert set(rep["targets"]) == {"propose_us_p50", "insert_ns_per_token", "bytes_per_token", "acceptance_length", "drafted_per_accepted"}
    assert {(e["drafter"], e["k"]) for e in rep["grid"]} >= {("das", 4), ("arctic_suffix", 4), ("ngram", 4)}
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


# ---- empty traces and result files


def test_replaying_an_empty_trace_is_a_clear_error(tmp_path, capsys):
    empty = tmp_path / "empty.parquet"
    write_trace(empty, [])
    with pytest.raises(ValueError, match="empty.parquet.*nothing to replay"):
        load_trace(empty)
    no_output = tmp_path / "no_output.parquet"
    write_trace(no_output, [Rollout(0, 1, "p", 0, [1, 2], [], "length")])
    with pytest.raises(ValueError, match="nothing to replay"):
        load_trace(no_output)
    assert main(["--trace", str(empty), "--no-frontier"]) == 2
    assert "nothing to replay" in capsys.readouterr().err


def test_existing_or_unwritable_report_is_refused_before_the_replay(tmp_path, capsys, monkeypatch, synthetic_trace):
    import benchmarks.replay as rp

    trace = synthetic_trace()
    out = tmp_path / "r.json"
    out.write_text("earlier result")
    monkeypatch.setattr(rp, "load_trace", lambda path: pytest.fail("the replay started"))
    assert main(["--trace", str(trace), "--json", str(out)]) == 2
    assert "exists" in capsys.readouterr().err and out.read_text() == "earlier result"
    assert main(["--trace", str(trace), "--json", "/proc/das-no-such-dir/r.json"]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_version_stride_spaces_the_policy_versions(tmp_path, synthetic_trace, oracle_drafter):
    """--version-stride N: iteration it runs at version 1 + it * N (a problem back once per epoch of N steps)."""
    its = load_trace(synthetic_trace(iterations=3))
    seen = []

    class _Versions(oracle_drafter):
        def begin_iteration(self, v):
            seen.append(v)

    replay(_Versions(its, 1), its, version_stride=300)
    assert seen == [1, 301, 601]
    with pytest.raises(SystemExit):
        main(["--version-stride", "0", "--trace", str(tmp_path / "trace.parquet")])


def test_targets_compare_das_with_arctic():
    from benchmarks.replay import targets

    def report(das_acc, das_dpa):
        return targets({"das": {"acceptance_length": das_acc, "drafted_per_accepted": das_dpa},
                        "arctic_suffix": {"acceptance_length": 2.0, "drafted_per_accepted": 3.0}})

    t = report(2.24, 2.9)
    assert t["acceptance_length"]["met"] and t["drafted_per_accepted"]["met"]
    assert t["drafted_per_accepted"]["target"] == "< 1.0 x arctic"
    t = report(2.2, 3.0)  # 1.1x arctic, and as many drafted per accepted: both missed
    assert not t["acceptance_length"]["met"] and t["acceptance_length"]["gap"] == pytest.approx(-0.04)
    assert not t["drafted_per_accepted"]["met"] and t["drafted_per_accepted"]["gap"] == 0.0
