"""Rewards: math-verify against LaTeX ground truth, sandboxed code execution against unit tests."""

from __future__ import annotations

import os

import pytest

from integrations.data.problems import CODE_PRELUDE, Problem
from integrations.rl.rewards import (
    code_reward,
    extract_code,
    last_boxed,
    make_reward_fn,
    math_reward,
    run_program,
    score_responses,
)


def code_problem(tests: str) -> Problem:
    return Problem("leetcode/t", [{"role": "user", "content": "two sum"}], None, "code", tests=tests, source="leetcode", prelude=CODE_PRELUDE)


def fenced(code: str) -> str:
    return f"Here it is:\n```python\n{code}\n```\nDone."


# ---- math


def test_last_boxed_balances_braces_and_takes_the_last():
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{3}{7}} end") == r"\frac{3}{7}"
    assert last_boxed(r"\boxed{ {a}{b} }") == " {a}{b} "
    assert last_boxed("no box") is None
    assert last_boxed(r"\boxed{unterminated") is None


@pytest.mark.parametrize(
    "gold,response",
    [(r"\frac{3}{7}", r"So \boxed{3/7}."), ("2", r"\boxed{2.0}"), (r"\sqrt{2}", r"\boxed{\sqrt 2}"), ("(1,2)", r"\boxed{(1, 2)}"),
     ("124", r"We get \boxed{124}")],
)
def test_math_equivalent_answers_score_one(gold, response):
    r = math_reward(response, gold)
    assert r.correct and r.score == 1.0 and r.formatted


def test_math_wrong_boxed_gets_format_reward_and_unboxed_gets_nothing():
    assert math_reward(r"\boxed{6}", "5").score == pytest.approx(0.1)
    assert math_reward(r"\boxed{6}", "5", format_weight=0.0).score == 0.0
    r = math_reward("the answer is 5", "5")
    assert (r.score, r.correct, r.formatted) == (0.0, False, False)
    assert math_reward("the answer is 5", "5", require_boxed=False).correct
    assert math_reward(r"\boxed{}", "5").score == 0.0  # empty box is not a format
    assert math_reward(r"\boxed{5}", None).score == 0.0


def test_math_on_dsr_sub_ground_truth(shared_dsr):
    for p in shared_dsr[:20]:
        if p.answer:
            assert math_reward(rf"... \boxed{{{p.answer}}}", p.answer).correct, p.answer


@pytest.fixture(scope="module")
def shared_dsr():
    from integrations.data.problems import load_problems

    return load_problems("dsr_sub", limit=20)  # shipped with the package


# ---- code


def test_extract_code_prefers_last_python_block_and_handles_truncation():
    assert extract_code("```\nA\n```\n```python\nB\n```\n```text\nC\n```") == "B\n"
    assert extract_code("```js\nX\n```") == "X\n"
    assert extract_code("text\n```python\ndef f():\n    return 1") == "def f():\n    return 1"
    assert extract_code("no code here") is None


def test_code_reward_passes_and_fails(two_sum):
    p = code_problem(two_sum.tests)
    assert code_reward(fenced(two_sum.ok), p).score == 1.0
    bad = code_reward(fenced("class Solution:\n    def twoSum(self, nums, target):\n        return [0, 0]"), p)
    assert (bad.correct, bad.formatted, bad.score) == (False, True, pytest.approx(0.1))
    assert "AssertionError" in bad.detail
    assert code_reward("I don't know", p).score == 0.0


@pytest.mark.slow  # five sandboxed programs, two of them run into their 1 s time limit
def test_code_runs_in_another_process_with_limits():
    parent = os.getpid()
    r = run_program(f"import os\nassert os.getpid() != {parent}\nopen('x.txt','w').write('ok')\n")
    assert r.passed, r.stderr_tail
    assert not os.path.exists("x.txt")  # ran in its own temporary directory
    loop = run_program("while True:\n    pass\n", timeout_s=1.0)
    assert loop.timed_out and not loop.passed and loop.seconds < 5
    mem = run_program("x = bytearray(3 << 30)\n", memory_mb=256)
    assert not mem.passed and "MemoryError" in mem.stderr_tail
    big = run_program("open('f', 'wb').write(b'0' * (8 << 20))\n", max_file_mb=1)
    assert not big.passed
    child = run_program("import os, time\nif os.fork() == 0:\n    time.sleep(30)\ntime.sleep(30)\n", timeout_s=1.0)
    assert child.timed_out and child.seconds < 5  # the whole process group is killed


def test_code_has_no_network():
    prog = "import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('1.1.1.1', 80))\n"
    r = run_program(prog)
    assert not r.passed and r.network_isolated
    assert "unreachable" in r.stderr_tail.lower() or "OSError" in r.stderr_tail


def test_run_program_rejects_bad_network_mode():
    with pytest.raises(ValueError):
        run_program("pass", network="maybe")


def test_score_responses_mixes_kinds(two_sum):
    math_p = Problem("m/1", [{"role": "user", "content": "1+1"}], "2", "math")
    code_p = code_problem(two_sum.tests)
    fn = make_reward_fn(format_weight=0.05)
    rs = fn([math_p, code_p, math_p, code_p], [r"\boxed{2}", fenced(two_sum.ok), r"\boxed{3}", "none"])
    assert [r.score for r in rs] == [1.0, 1.0, pytest.approx(0.05), 0.0]
    with pytest.raises(ValueError):
        score_responses([math_p], [])
