"""Code rewards that cannot be forged, and a sandbox that holds (issue #13).

Every test here runs real untrusted-looking code through the real sandbox (bubblewrap); nothing
is mocked except, in the fail-closed tests, the presence of bubblewrap itself.
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from integrations.data.problems import CODE_PRELUDE, Problem, load_embedded, load_leetcode_json
from integrations.rl import sandbox
from integrations.rl.rewards import (
    STDERR_CAP,
    SandboxUnavailable,
    check_sandbox,
    code_reward,
    extract_code,
    last_boxed,
    math_reward,
    run_program,
    run_tests,
)
from integrations.rl.sandbox import codec, harness_launcher

REPO = Path(__file__).resolve().parents[1]
LEETCODE = REPO.parent / "shared" / "data" / "leetcode_train.json"

sandboxed = pytest.mark.slow  # runs programs in the sandbox (a bubblewrap process each, up to seconds)

REVERSE_TESTS = """
def check(candidate):
    assert is_same_list(candidate(head = list_node([1, 2, 3, 4, 5])), list_node([5, 4, 3, 2, 1]))
    assert candidate(head = list_node([])) is None

check(Solution().reverseList)
"""
REVERSE_OK = """class Solution:
    def reverseList(self, head: Optional[ListNode]) -> Optional[ListNode]:
        prev = None
        while head:
            head.next, prev, head = prev, head, head.next
        return prev
"""
INVERT_TESTS = """
def check(candidate):
    assert is_same_tree(candidate(root = tree_node([4, 2, 7, 1, 3, 6, 9])), tree_node([4, 7, 2, 9, 6, 3, 1]))
    assert is_same_tree(candidate(root = tree_node([])), tree_node([]))

check(Solution().invertTree)
"""
INVERT_OK = """class TreeNode:  # the solution's own copy of the judge's class
    def __init__(self, val=0, left=None, right=None):
        self.val, self.left, self.right = val, left, right

class Solution:
    def invertTree(self, root):
        if root:
            root.left, root.right = self.invertTree(root.right), self.invertTree(root.left)
        return root
"""


def problem(tests: str) -> Problem:
    return Problem("leetcode/t", [{"role": "user", "content": "p"}], None, "code", tests=tests, source="leetcode", prelude=CODE_PRELUDE)


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


def assert_forgery_fails(code: str, tests: str) -> None:
    r = code_reward(fenced(code), problem(tests))
    assert not r.correct and r.score < 1.0, (code, r)


# ---------------------------------------------------------------- the pass cannot be forged


@sandboxed
@pytest.mark.skipif(not LEETCODE.is_file(), reason="shared LeetCode data missing")
def test_early_exit_scores_zero_on_the_first_leetcode_problem():
    p = load_leetcode_json(LEETCODE, limit=1)[0]
    for code in ("import os\nos._exit(0)", "raise SystemExit(0)", "import sys\nsys.exit(0)"):
        r = code_reward(f"```python\n{code}\n```", p)
        assert (r.score, r.correct) == (0.0, False) and "exited early" in r.detail, (code, r)
    assert code_reward(fenced(p.answer), p).correct  # the reference solution still passes


@sandboxed
@pytest.mark.parametrize("code", [
    "import os\nos._exit(0)",
    "raise SystemExit(0)",
    "import sys\nsys.exit(0)",
    # exits from inside the call the tests make
    "import os\nclass Solution:\n    def twoSum(self, nums, target):\n        os._exit(0)",
    "import sys\nclass Solution:\n    def twoSum(self, nums, target):\n        sys.exit(0)",
    # atexit hooks that would turn a failure into a clean exit
    "import atexit, os\natexit.register(lambda: os._exit(0))\nclass Solution:\n    def twoSum(self, nums, target):\n        return [9, 9]",
    # wrong answer behind a SystemExit raised from a destructor / excepthook
    "import sys, os\nsys.excepthook = lambda *a: os._exit(0)\nclass Solution:\n    def twoSum(self, nums, target):\n        return [9, 9]",
])
def test_exits_and_exit_hooks_do_not_pass(code, two_sum):
    assert_forgery_fails(code, two_sum.tests)
    if "return [9, 9]" not in code:  # ended its own process before the tests finished: not even the format reward
        assert code_reward(fenced(code), problem(two_sum.tests)).score == 0.0


@sandboxed
def test_an_object_equal_to_everything_does_not_pass(two_sum):
    assert_forgery_fails("class Eq:\n    def __eq__(self, o): return True\n    def __ne__(self, o): return False\n"
                         "class Solution:\n    def twoSum(self, nums, target):\n        return Eq()", two_sum.tests)
    assert_forgery_fails("class L(list):\n    def __eq__(self, o): return True\n"
                         "class Solution:\n    def twoSum(self, nums, target):\n        return L([9])", two_sum.tests)


@sandboxed
def test_patched_builtins_and_helpers_do_not_pass(two_sum):
    patch = ("import builtins\nbuiltins.AssertionError = type('Quiet', (Exception,), {})\n"
             "builtins.isinstance = lambda *a: True\nbuiltins.abs = lambda x: 0\nbuiltins.len = lambda x: 0\n"
             "is_same_list = is_same_tree = lambda a, b: True\n"
             "def list_node(v): return None\ndef tree_node(v): return None\n")
    assert_forgery_fails(patch + "class Solution:\n    def twoSum(self, nums, target):\n        return [9, 9]", two_sum.tests)
    assert_forgery_fails(patch + "class Solution:\n    def reverseList(self, head):\n        return head", REVERSE_TESTS)
    assert_forgery_fails("import sys\nsys.settrace(lambda *a: None)\nclass Solution:\n    def reverseList(self, head):\n"
                         "        return head", REVERSE_TESTS)


@sandboxed
def test_output_that_imitates_a_verdict_does_not_pass(two_sum):
    fake = json.dumps({"pass": True, "detail": "passed", "mac": "0" * 64})
    code = (f"import os, sys\nline = {fake!r} + '\\n'\nprint(line)\nsys.stderr.write(line)\n"
            "for fd in range(0, 1024):\n    try:\n        os.write(fd, line.encode())\n    except OSError:\n        pass\n"
            "for pid in os.listdir('/proc'):\n    for fd in range(0, 64):\n        try:\n"
            "            f = os.open(f'/proc/{pid}/fd/{fd}', os.O_WRONLY | os.O_NONBLOCK)\n            os.write(f, line.encode())\n"
            "        except (OSError, ValueError):\n            pass\n"
            "class Solution:\n    def twoSum(self, nums, target):\n        return [9, 9]\n")
    assert_forgery_fails(code, two_sum.tests)


@sandboxed
def test_the_solution_cannot_read_the_tests_or_the_harness(monkeypatch, two_sum):
    # The solution's process never holds the tests (the expected answers) or the harness's secret.
    monkeypatch.setattr(secrets, "token_bytes", lambda n: b"\x5a" * n)
    code = ("import os, glob\nfound = []\n"
            "for path in glob.glob('/proc/*/environ') + glob.glob('/proc/*/cmdline') + glob.glob('/proc/*/mem') + glob.glob('/tmp/**', recursive=True):\n"
            "    try:\n        data = open(path, 'rb').read(1 << 20)\n    except OSError:\n        continue\n"
            "    if b'candidate([3, 2, 4], 6)' in data or b'5a5a5a5a5a5a5a5a' in data or b'ZZZZZZZZZZZZZZZZ' in data:\n"
            "        found.append(path)\n"
            "class Solution:\n    def twoSum(self, nums, target):\n        if found:\n            raise RuntimeError(str(found))\n"
            "        for i, x in enumerate(nums):\n            if target - x in nums[i + 1:]:\n"
            "                return [i, nums.index(target - x, i + 1)]\n")
    r = code_reward(fenced(code), problem(two_sum.tests))
    assert r.correct, r.detail


@sandboxed
def test_correct_solutions_pass_with_lists_linked_lists_and_trees(two_sum):
    assert code_reward(fenced(two_sum.ok), problem(two_sum.tests)).correct
    assert code_reward(fenced(REVERSE_OK), problem(REVERSE_TESTS)).correct
    r = code_reward(fenced(INVERT_OK + "\nprint('debug output')\nimport sys; print('x' * 5000, file=sys.stderr)\n"), problem(INVERT_TESTS))
    assert r.correct, r.detail
    bad = code_reward(fenced(INVERT_OK.replace("self.invertTree(root.right), self.invertTree(root.left)",
                                               "self.invertTree(root.left), self.invertTree(root.right)")), problem(INVERT_TESTS))
    assert not bad.correct and "AssertionError" in bad.detail


@sandboxed
def test_reference_solutions_pass_and_entry_points_shadow_prelude_names():
    he = {p.problem_id: p for p in load_embedded("code")}
    # HumanEval/85's entry point is `add` (the prelude imports operator.add), /131's is `digits`
    # (string.digits); /32's tests call the solution's own `poly`.
    for pid in ("HumanEval/0", "HumanEval/32", "HumanEval/85", "HumanEval/131"):
        p = he[pid]
        r = run_tests(p.answer, p.tests, prelude=p.prelude)
        assert r.passed, (pid, r.detail, r.stderr_tail[-500:])
    missing = run_tests("def something_else(x):\n    return x\n", he["HumanEval/85"].tests, prelude=CODE_PRELUDE)
    assert not missing.passed and "NameError" in missing.detail  # operator.add is not the solution
    if LEETCODE.is_file():
        probs = load_leetcode_json(LEETCODE)
        picks = [probs[0], next(q for q in probs if "tree_node(" in q.tests), next(q for q in probs if "list_node(" in q.tests)]
        for q in picks:
            r = code_reward(fenced(q.answer), q)
            assert r.correct, (q.problem_id, r.detail)


# ---------------------------------------------------------------- the sandbox holds


@sandboxed
def test_sandbox_child_is_unprivileged_and_sees_nothing_of_the_host(tmp_path, monkeypatch):
    monkeypatch.setenv("DAS_TEST_MARKER", "trainer-secret-41")
    host_ns = {k: os.readlink(f"/proc/self/ns/{k}") for k in ("pid", "net", "mnt")}
    venv_file = Path(os.__file__).resolve().parent / "das_sandbox_probe.txt"
    project_file = REPO / "das_sandbox_probe.txt"
    prog = f"""
import glob, os, sys
assert os.getuid() != 0 and os.geteuid() != 0, os.getuid()
caps = {{l.split()[0]: int(l.split()[1], 16) for l in open('/proc/self/status') if l.startswith('Cap')}}
assert not any(caps.values()), caps
assert 'NoNewPrivs:\\t1' in open('/proc/self/status').read()
for k, v in {host_ns!r}.items():
    assert os.readlink(f'/proc/self/ns/{{k}}') != v, k
for path in ['/etc/shadow', '/root/.bashrc', {str(Path.home())!r}]:
    try:
        open(path).read(); raise SystemExit('read ' + path)
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        pass
for path in glob.glob('/proc/*/environ'):
    try:
        assert b'trainer-secret-41' not in open(path, 'rb').read(), path
    except PermissionError:
        pass
for path in [{str(venv_file)!r}, {str(project_file)!r}, sys.prefix + '/x', '/usr/x', '/etc/x']:
    try:
        open(path, 'w').write('x'); raise SystemExit('wrote ' + path)
    except OSError:
        pass
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
for path in glob.glob('/proc/*/ns/net'):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        continue
    assert libc.setns(fd, 0) != 0, 'setns into ' + path
assert len(os.listdir('/proc/self/task')) == 1
assert sorted(int(p) for p in os.listdir('/proc') if p.isdigit())[0] == 1  # own PID namespace
open('/tmp/scratch', 'w').write('private tmp is writable')
"""
    r = run_program(prog)
    assert r.passed, r.stderr_tail
    assert not venv_file.exists() and not project_file.exists()


@sandboxed
def test_network_is_cut_unless_explicitly_allowed():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    port = server.getsockname()[1]
    try:
        prog = f"import socket\ns = socket.socket()\ns.settimeout(3)\ns.connect(('127.0.0.1', {port}))\n"
        cut = run_program(prog)
        assert not cut.passed and cut.network_isolated and "ConnectionRefused" in cut.stderr_tail
        outside = run_program("import socket\ns = socket.socket()\ns.settimeout(3)\ns.connect(('1.1.1.1', 80))\n")
        assert not outside.passed and "unreachable" in outside.stderr_tail.lower()
        allowed = run_program(prog, network="allow")
        assert allowed.passed and not allowed.network_isolated, allowed.stderr_tail
    finally:
        server.close()


@sandboxed
def test_process_limit_stops_a_fork_loop():
    prog = """
import os, time
n = 0
try:
    for _ in range(200):
        if os.fork() == 0:
            time.sleep(5)
            os._exit(0)
        n += 1
except BlockingIOError:
    raise SystemExit(0 if n < 20 else 5)
raise SystemExit(7)  # 200 processes and no limit
"""
    r = run_program(prog, max_procs=16, timeout_s=20)
    assert r.returncode == 0 and r.passed, (r.returncode, r.stderr_tail)


def _host_processes_with(token: str) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if token.encode() in (p / "cmdline").read_bytes():
                    out.append(int(p.name))
            except OSError:
                pass
    return out


@sandboxed
def test_a_child_that_closes_stdio_does_not_outlive_the_run():
    token = "987.654321"
    prog = f"""
import os
if os.fork() == 0:
    os.setsid()
    for fd in (0, 1, 2):
        os.close(fd)
    os.execv('/usr/bin/sleep', ['sleep', '{token}'])
import time; time.sleep(0.3)
"""
    r = run_program(prog, timeout_s=10)
    assert r.passed and r.seconds < 5
    time.sleep(0.2)
    assert _host_processes_with(token) == []


@sandboxed
def test_a_setsid_grandchild_holding_stderr_cannot_stretch_the_limit():
    token = "876.543219"
    leaves = f"import subprocess\nsubprocess.Popen(['setsid', 'sleep', '{token}'])\n"
    r = run_program(leaves, timeout_s=6)
    assert r.passed and r.seconds < 3, r
    hangs = leaves + "import time\ntime.sleep(1000)\n"
    t0 = time.monotonic()
    r = run_program(hangs, timeout_s=2)
    assert r.timed_out and not r.passed and time.monotonic() - t0 < 4, r
    time.sleep(0.2)
    assert _host_processes_with(token) == []


@sandboxed
def test_stderr_is_capped():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    prog = "import os\nchunk = b'e' * (1 << 20)\nfor _ in range(300):\n    os.write(2, chunk)\n"
    r = run_program(prog, timeout_s=30)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert r.passed and len(r.stderr_tail) <= STDERR_CAP and grown_mb < 100, (len(r.stderr_tail), grown_mb)


def test_fails_closed_without_bubblewrap(without_bwrap, two_sum):
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        run_program("pass")
    with pytest.raises(SandboxUnavailable, match="network='allow'"):
        check_sandbox(sandbox="none")
    with pytest.raises(SandboxUnavailable):
        code_reward(fenced(two_sum.ok), problem(two_sum.tests))
    r = run_program("import os\nassert os.getpid() > 1\n", sandbox="none", network="allow")  # the explicit opt-out
    assert r.passed and not r.sandboxed and not r.network_isolated
    assert code_reward(fenced(two_sum.ok), problem(two_sum.tests), sandbox="none", network="allow").correct


def test_bad_limits_are_refused():
    for kw in ({"timeout_s": 0}, {"timeout_s": float("nan")}, {"memory_mb": -1}, {"max_procs": 0}, {"sandbox": "docker"}):
        with pytest.raises(ValueError):
            run_program("pass", **kw)


# ---------------------------------------------------------------- extraction and threads


def test_answer_extraction_is_linear():
    for text in ("\\boxed{" * 30_000, "\\boxed{" * 120_000, "\\boxed{" * 10 + "{" * 500_000, "{}" * 500_000 + "\\boxed{7}"):
        t0 = time.perf_counter()
        last_boxed(text)
        assert time.perf_counter() - t0 < 1.0
    assert last_boxed("{}" * 500_000 + "\\boxed{7}") == "7"
    assert last_boxed("\\boxed{\\boxed{1}}") == "1" and last_boxed("\\boxed{a} \\fbox {b}") == "b"
    for text in ("```" * 100_000, "```\n" * 100_000, "```py" + "x" * 1_000_000, "```\n" + "`" * 200_000):
        t0 = time.perf_counter()
        extract_code(text)
        assert time.perf_counter() - t0 < 1.0
    assert extract_code("```\nA\n```\n```python\nB\n```\n```text\nC\n```") == "B\n"


def test_math_reward_from_worker_threads():
    jobs = [("So \\boxed{3/7}.", "\\frac{3}{7}"), ("\\boxed{6}", "5"), ("\\boxed{\\frac{}{}}", "1"), ("no box", "1")]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda j: math_reward(*j), jobs))
    assert [r.correct for r in got] == [True, False, False, False]
    assert got[1].score == pytest.approx(0.1) and got[3].score == 0.0
    assert threading.current_thread() is threading.main_thread() and math_reward("\\boxed{2}", "2").correct


# ---------------------------------------------------------------- the modules inside the sandbox, imported directly


def _no_handles(v):
    return None


plain_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=2**12000, max_value=2**12000 + 5)
    | st.floats(allow_nan=False) | st.text(max_size=8) | st.binary(max_size=8)
    | st.complex_numbers(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner) | st.dictionaries(st.text(max_size=4) | st.integers(), inner, max_size=4)
    | st.frozensets(st.integers() | st.text(max_size=4), max_size=4) | st.sets(st.integers(), max_size=4),
    max_leaves=20)


@settings(max_examples=150, deadline=None)
@given(value=plain_values)
def test_codec_round_trips_plain_data_through_json_with_its_types(value):
    msg = json.loads(json.dumps(codec.encode(value, _no_handles, _no_handles, True)))
    back = codec.decode(msg, lambda name: None, setattr, lambda h: None)

    def same(a, b):
        if type(a) is not type(b):
            return False
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return a == b

    assert same(value, back)


class Node:
    def __init__(self, val=0, next=None):
        self.val, self.next = val, next


def test_codec_sends_data_objects_by_value_cycles_and_long_chains_included():
    a = Node(1)
    a.next = Node(2, a)  # a cycle
    long = Node(0)
    tail = long
    for i in range(5000):  # deeper than the nesting limit: objects go through the table, not recursion
        tail.next = Node(i + 1)
        tail = tail.next

    def name(v):
        return "Node" if type(v) is Node else None

    for root in (a, long):
        msg = json.loads(json.dumps(codec.encode(root, name, _no_handles, True)))
        back = codec.decode(msg, lambda n: Node.__new__(Node), setattr, _no_handles)
        assert type(back) is Node and back.val == root.val
    back = codec.decode(json.loads(json.dumps(codec.encode(a, name, _no_handles, True))), lambda n: Node.__new__(Node), setattr,
                        _no_handles)
    assert back.next.next is back and back.next.val == 2


def test_codec_converts_the_solutions_subclasses_honestly_and_refuses_what_it_cannot_send():
    class Sneaky(int):
        def __eq__(self, other):
            return True

    msg = codec.encode([Sneaky(3), True, np.int64(7), np.float32(0.5)], _no_handles, _no_handles, False)
    assert msg == {"v": ["L", 3, True, 7, 0.5], "o": {}}
    with pytest.raises(codec.CodecError, match="cannot send a Sneaky"):
        codec.encode(Sneaky(3), _no_handles, _no_handles, True)  # the harness's side sends exact types only
    assert codec.encode(object, _no_handles, lambda v: 4, True) == {"v": ["H", 4], "o": {}}
    with pytest.raises(codec.CodecError, match="too deeply"):
        nested: list = []
        for _ in range(codec.MAX_DEPTH + 2):
            nested = [nested]
        codec.encode(nested, _no_handles, _no_handles, True)


@pytest.mark.parametrize("msg", [
    None, [], {"v": 1}, {"v": ["Q", 1], "o": {}}, {"v": ["D", [1]], "o": {}}, {"v": ["O", "0"], "o": {}},
    {"v": ["O", 0], "o": {"0": ["Node"]}}, {"v": ["O", 0], "o": {"0": ["Node", {"__class__": 1}]}},
    {"v": ["N", 5], "o": {}}, {"v": ["C", "1", 2], "o": {}}, {"v": ["H", "x"], "o": {}}, {"v": [], "o": {}},
])
def test_codec_refuses_malformed_messages(msg):
    with pytest.raises(codec.CodecError):
        codec.decode(msg, lambda n: Node.__new__(Node), setattr, _no_handles)


def test_the_harness_takes_the_tests_entry_points_from_the_solution_and_the_rest_from_itself():
    import ast

    tree = ast.parse("import math\nhelper = 1\ndef check(candidate):\n    assert is_same(candidate(poly(1)), math.pi)\n"
                     "check(Solution().f)\ncheck(add, key=other)\n")
    entry, bound, loads = harness_launcher.names_in_tests(tree)
    assert entry == {"Solution", "add", "other"}  # check is bound by the tests themselves
    assert bound == {"math", "helper", "check"}
    assert {"is_same", "poly", "candidate"} <= loads


def test_the_sandboxed_modules_run_under_python_isolated_as_with_dash_m():
    import subprocess
    import sys

    r = subprocess.run(sandbox.command(sys.executable, sandbox.PROBE), capture_output=True, text=True, timeout=60, cwd="/")
    if os.geteuid() == 0:  # not sandboxed here: root can setuid(0), and the probe says so
        assert (r.returncode, r.stdout.strip()) == (3, "setuid(0) worked"), r.stderr
    else:
        assert r.returncode == 0, r.stderr
