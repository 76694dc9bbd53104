"""The proposer's per-request state, options and length history (no vLLM)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from integrations.vllm_ext.request_state import LengthHistory, RequestState, request_options


def test_slots_are_reused_zeroed_and_the_arrays_grow_when_full():
    st = RequestState(k=4, slots=2)
    a = st.take(10, 100, 4, True, "p")
    st.accepted[a] = 7
    b = st.take(5, 50, 0, False)
    c = st.take(3, 30, 2, True, "q")  # no slot free: the arrays double
    assert st.seen.shape[0] == 4 and len(st.problem_id) == 4 and st.last_probs.shape == (4, 4)
    assert (st.seen[c], st.prompt_len[c], st.max_tokens[c], st.cap[c], st.problem_id[c]) == (3, 3, 30, 2, "q")
    st.free.append(a)
    d = st.take(1, 10, 1, True, "r")
    assert d == a and st.accepted[d] == 0 and st.problem_id[d] == "r" and not st.tracked[b]


def test_offered_drafts_are_what_the_next_verification_is_scored_against():
    st = RequestState(k=4)
    slots = np.array([st.take(2, 100, 4, True, "p") for _ in range(3)])
    probs = np.array([[0.9, 0.5, 0.2, 0.0], [0.8, 0.0, 0.0, 0.0], [0.7, 0.6, 0.5, 0.4]], np.float32)
    drafting = st.offered(slots, np.array([True, True, False]), np.array([2, 0, 0]), probs, lambda p: p * 0.5)
    assert drafting.tolist() == [0]
    assert st.last_len[slots].tolist() == [2, 0, 0] and st.drafted[slots].tolist() == [2, 0, 0]
    assert st.last_psum[slots[0]] == pytest.approx(0.5 * (0.9 + 0.5))  # calibrated, summed: expected accepted
    psum = st.verified(slots[:1], np.array([1]))
    assert psum.tolist() == pytest.approx([0.7]) and st.accepted[slots[0]] == 1 and st.predicted[slots[0]] == pytest.approx(0.7)


@pytest.mark.parametrize("extra,match", [("x", "extra_args must be a dict"), ({"das_max_draft_tokens": -1}, "das_max_draft_tokens"),
                                         ({"das_max_draft_tokens": True}, "das_max_draft_tokens"), ({"das_problem_id": [1]}, "das_problem_id"),
                                         ({"das_warmup": 1}, "das_warmup")])
def test_bad_request_options_are_named(extra, match):
    with pytest.raises(ValueError, match=match):
        request_options(SimpleNamespace(extra_args=extra), 8)


def test_request_options_default_to_k_and_no_problem_id():
    assert request_options(None, 8) == (None, 8, False)
    assert request_options(SimpleNamespace(extra_args={"das_problem_id": "p", "das_max_draft_tokens": 3, "das_warmup": True}), 8) == ("p", 3, True)


def test_length_history_keeps_lengths_until_a_predictor_exists_and_caps_them():
    h = LengthHistory()
    h.finished("p", 50)
    h.flush(1)  # no predictor yet: kept
    h.finished("p", 5000)
    pred = h.predictor(np.array([100, 400]), policy_version=2)
    assert pred.max_tokens == 400 and h.model is pred
    assert sorted(pred.history_lengths("p").tolist()) == [50, 400]  # capped at the predictor's max_tokens
    h.finished("q", 10)
    h.flush(3)
    assert pred.history_lengths("q").tolist() == [10]


def test_length_history_resizes_the_predictor_for_longer_requests_and_keeps_its_history():
    h = LengthHistory()
    h.finished("warm", 16)
    short = h.predictor(np.array([16]), policy_version=0)  # an engine's warm-up requests come first
    assert short.max_tokens == 16
    long = h.predictor(np.array([16, 1024]), policy_version=0)
    assert long.max_tokens == 1024 and h.model is long
    assert long.history_lengths("warm").tolist() == [16]
    assert long.index(["warm"]).tolist() == short.index(["warm"]).tolist()
    h.finished("p", 900)
    h.flush(1)
    assert long.history_lengths("p").tolist() == [900]  # no longer capped at 16
    assert h.predictor(np.array([512]), policy_version=1) is long  # a shorter request keeps the size
