"""Tests for integrations.data.problems: loaders on the shipped files (DSR-sub, MATH-500), the embedded sets and
the rLLM LeetCode file, dispatch, errors, chat-template rendering. Real data, no mocks; the LeetCode file's tests
skip when ../shared/data is absent (the data registry's own tests, including the hub download, are in
tests/test_data_registry.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from integrations.data.problems import (
    CODE_PRELUDE,
    MATH_INSTRUCTION,
    Problem,
    load_embedded,
    load_leetcode_json,
    load_problems,
    load_verl_parquet,
    render_prompts,
)

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "integrations" / "data" / "files"  # the data shipped with the package
DATA = REPO.parent / "shared" / "data"
needs_data = pytest.mark.skipif(
    not (DATA / "leetcode_train.json").is_file(),
    reason=f"shared data directory {DATA} (../shared/data from the repo root, holding leetcode_train.json) is missing",
)


def _runs_ok(program: str) -> bool:
    r = subprocess.run([sys.executable, "-c", program], capture_output=True, timeout=60)
    return r.returncode == 0


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)  # the session's tiny model (conftest): no second build


# ---------------------------------------------------------------- shared files


def test_dsr_sub_loads_with_answers_and_instruction():
    probs = load_verl_parquet(SHIPPED / "dsr_sub.parquet")
    assert len(probs) == 1209
    assert len({p.problem_id for p in probs}) == 1209
    p0 = probs[0]
    assert p0.problem_id == "deepscaler/0"
    assert p0.source == "deepscaler" and p0.kind == "math" and p0.tests is None
    assert p0.answer == "\\frac{3}{7}"
    assert p0.messages[0]["role"] == "user"
    assert p0.messages[0]["content"].endswith(" " + MATH_INSTRUCTION)
    # one row (index 265) has an empty ground truth; it is loaded with answer=None
    assert [p.problem_id for p in probs if p.answer is None] == ["deepscaler/265"]
    assert all(p.answer.strip() for p in probs if p.answer is not None)
    # DSR-sub prompts already carry the instruction: the loader must not add it twice
    assert all(p.prompt_text.count("\\boxed") == 1 for p in probs)


def test_limit_keeps_the_first_rows():
    full = load_verl_parquet(SHIPPED / "dsr_sub.parquet")
    assert load_verl_parquet(SHIPPED / "dsr_sub.parquet", limit=5) == full[:5]
    assert load_verl_parquet(SHIPPED / "dsr_sub.parquet", limit=0) == []
    with pytest.raises(ValueError, match="limit"):
        load_verl_parquet(SHIPPED / "dsr_sub.parquet", limit=-1)


def test_math500_gets_the_boxed_instruction():
    probs = load_verl_parquet(SHIPPED / "math500.parquet")
    assert len(probs) == 500
    assert probs[0].source == "simplerl/math500"
    assert all(p.prompt_text.endswith(" " + MATH_INSTRUCTION) for p in probs)
    raw = load_verl_parquet(SHIPPED / "math500.parquet", limit=3, ensure_boxed_instruction=False)
    assert all("\\boxed" not in p.prompt_text for p in raw)
    assert probs[0].answer == raw[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"


@needs_data
@pytest.mark.slow  # 1889 problems and four Python processes
def test_leetcode_loads_and_reference_solutions_pass_their_tests():
    probs = load_leetcode_json(DATA / "leetcode_train.json")
    assert len(probs) == 1889
    p = probs[0]
    assert p.problem_id == "leetcode/0" and p.kind == "code" and p.source == "leetcode"
    assert "def check(candidate)" in p.tests and "check(Solution()." in p.tests
    assert "python" in p.prompt_text.lower() and "class Solution" in p.prompt_text
    assert p.prelude == CODE_PRELUDE
    assert all(q.answer and q.tests for q in probs)
    # reference solutions pass (the tree / linked-list helpers come from the prelude) ...
    tree = next(q for q in probs if "tree_node(" in q.tests)
    linked = next(q for q in probs if "list_node(" in q.tests)
    for q in (p, tree, linked):
        assert _runs_ok(q.test_program(q.answer)), q.problem_id
    # ... and a wrong one fails
    wrong = "class Solution:\n    def twoSum(self, nums, target):\n        return [0, 0]\n"
    assert not _runs_ok(p.test_program(wrong))


def test_code_prelude_is_the_leetcode_prelude_module_and_its_helpers_work():
    """CODE_PRELUDE is integrations/data/leetcode_prelude.py without its docstring (a linted module, not a
    string); run as the sandbox runs it, it gives the names LeetCode stubs and tests use."""
    module = (REPO / "integrations" / "data" / "leetcode_prelude.py").read_text()
    assert module.endswith(CODE_PRELUDE) and module.startswith('"""') and CODE_PRELUDE.startswith("import ")
    limit = sys.getrecursionlimit()
    ns: dict = {}
    try:
        exec(compile(CODE_PRELUDE, "<prelude>", "exec"), ns)
    finally:
        sys.setrecursionlimit(limit)  # the prelude raises it for the solution's process
    assert {"List", "Optional", "Counter", "deque", "heappush", "inf"} <= set(ns)
    list_node, is_same_list = ns["list_node"], ns["is_same_list"]
    assert is_same_list(list_node([1, 2, 3]), list_node([1, 2, 3])) and list_node([]) is None
    assert not is_same_list(list_node([1, 2, 3]), list_node([1, 2])) and not is_same_list(list_node([1, 2]), list_node([1, 3]))
    tree_node, is_same_tree = ns["tree_node"], ns["is_same_tree"]
    root = tree_node([4, 2, 7, None, 3])  # level order, None for a missing child
    assert (root.val, root.left.val, root.right.val, root.left.left, root.left.right.val) == (4, 2, 7, None, 3)
    assert is_same_tree(root, tree_node([4, 2, 7, None, 3])) and not is_same_tree(root, tree_node([4, 2, 7, 3]))


def test_leetcode_tests_given_as_python_literal_string(tmp_path):
    src = "def check(candidate):\n    assert candidate(1) == 2\n\ncheck(Solution().f)"
    rows = [{"problem": "Add one. Use python.", "solutions": "x", "tests": repr({"functional": src})}]
    f = tmp_path / "lc.json"
    f.write_text(json.dumps(rows))
    (p,) = load_leetcode_json(f)
    assert p.tests == src
    assert _runs_ok(p.test_program("class Solution:\n    def f(self, x):\n        return x + 1\n"))


def test_leetcode_bad_rows_raise_with_path(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"problem": "not a list"}))
    with pytest.raises(ValueError, match="bad.json"):
        load_leetcode_json(f)
    f.write_text(json.dumps([{"problem": "p", "tests": "{'inputs': []}"}]))
    with pytest.raises(ValueError, match="functional"):
        load_leetcode_json(f)
    f.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        load_leetcode_json(f)


# ---------------------------------------------------------------- embedded sets


def test_embedded_math_is_champ_with_answers():
    probs = load_embedded("math")
    assert len(probs) == 270
    assert len({p.problem_id for p in probs}) == 270
    assert all(p.kind == "math" and p.source == "champ" and p.answer for p in probs)
    assert all(p.prompt_text.endswith(" " + MATH_INSTRUCTION) for p in probs)
    assert all("@@" not in p.prompt_text and "@@" not in p.answer for p in probs)
    assert probs[0].problem_id == "champ/P_Combinatorics_1"
    assert load_embedded("champ", limit=3) == probs[:3]


def test_embedded_code_is_humaneval_with_passing_tests():
    probs = load_embedded("code")
    assert len(probs) == 164
    p = probs[0]
    assert p.problem_id == "HumanEval/0" and p.kind == "code" and p.source == "humaneval"
    assert "def has_close_elements" in p.prompt_text
    assert p.tests.rstrip().endswith("check(has_close_elements)")
    assert all(q.tests and q.answer for q in probs)
    assert _runs_ok(p.test_program(p.answer))
    assert not _runs_ok(p.test_program("def has_close_elements(numbers, threshold):\n    return True\n"))


def test_embedded_unknown_kind():
    with pytest.raises(ValueError, match="'logic'"):
        load_embedded("logic")


def test_math_problem_has_no_test_program():
    p = load_embedded("math", limit=1)[0]
    with pytest.raises(ValueError, match="no code tests"):
        p.test_program("x = 1")
    with pytest.raises(ValueError, match="kind"):
        Problem("x", [], None, "poetry")


# ---------------------------------------------------------------- dispatch and errors


def test_load_problems_embedded_specs():
    assert [p.problem_id for p in load_problems(None, limit=2)] == ["champ/P_Combinatorics_1", "champ/P_Combinatorics_2"]
    assert load_problems("champ", limit=2) == load_problems(None, limit=2)
    assert load_problems("humaneval", limit=1)[0].problem_id == "HumanEval/0"


def test_load_problems_paths_and_short_names():
    assert load_problems(str(SHIPPED / "dsr_sub.parquet"), limit=2) == load_problems("dsr_sub", limit=2) == load_problems("DSR", limit=2)
    assert load_problems(SHIPPED / "math500.parquet", limit=1)[0].source == "simplerl/math500"
    assert load_problems("math500", limit=1) == load_problems(SHIPPED / "math500.parquet", limit=1)


@needs_data
def test_a_data_dir_copy_wins_over_the_shipped_and_cached_ones():
    assert load_problems(str(DATA / "leetcode_train.json"), limit=1)[0].kind == "code"
    assert load_problems("leetcode", limit=1, data_dir=DATA)[0].problem_id == "leetcode/0"
    assert load_problems("dsr_sub", limit=3, data_dir=DATA) == load_problems("dsr_sub", limit=3)


def test_missing_paths_raise_file_not_found_naming_the_path(tmp_path, monkeypatch):
    for name in ("nope.parquet", "nope.json"):
        missing = tmp_path / name
        with pytest.raises(FileNotFoundError, match=name):
            load_problems(str(missing))
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        load_verl_parquet(tmp_path / "nope.parquet")
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_leetcode_json(tmp_path / "nope.json")
    monkeypatch.setattr("integrations.data.registry.hub_file", lambda d: None)  # whatever this machine's hub cache holds
    with pytest.raises(FileNotFoundError, match="python -m integrations.data download leetcode"):
        load_problems("leetcode", data_dir=tmp_path)


def test_unknown_spec_raises_value_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match="problems.csv"):
        load_problems(str(tmp_path / "problems.csv"))
    with pytest.raises(ValueError, match="gsm8k"):
        load_problems("gsm8k")


def test_bad_parquet_raises_value_error(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "junk.parquet"
    f.write_text("not parquet")
    with pytest.raises(ValueError, match="junk.parquet"):
        load_verl_parquet(f)
    g = tmp_path / "wrong.parquet"
    pq.write_table(pa.table({"question": ["1+1"], "answer": ["2"]}), g)
    with pytest.raises(ValueError, match="missing columns"):
        load_verl_parquet(g)


def test_verl_parquet_without_extra_info_and_code_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    g = tmp_path / "mini.parquet"
    table = pa.table(
        {
            "data_source": ["toy", "toycode"],
            "prompt": [[{"role": "user", "content": "1+1?"}], [{"role": "user", "content": "write f"}]],
            "ability": ["math", "code"],
            "reward_model": [{"ground_truth": "2", "style": "rule"}, {"ground_truth": "assert f() == 1", "style": "rule"}],
        }
    )
    pq.write_table(table, g)
    math, code = load_verl_parquet(g)
    assert math.problem_id == "toy/0" and math.answer == "2" and math.prompt_text == "1+1? " + MATH_INSTRUCTION
    assert code.problem_id == "toycode/1" and code.kind == "code" and code.tests == "assert f() == 1"
    assert code.answer is None and code.prompt_text == "write f"


# ---------------------------------------------------------------- rendering


def test_render_prompts_uses_the_chat_template(tiny_tokenizer):
    probs = load_embedded("math", limit=3) + load_embedded("code", limit=1)
    ids = render_prompts(probs, tiny_tokenizer)
    assert len(ids) == 4
    assert all(isinstance(t, int) and 0 <= t < len(tiny_tokenizer) for seq in ids for t in seq)
    im_start, im_end = tiny_tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    for p, seq in zip(probs, ids):
        text = tiny_tokenizer.decode(seq)
        assert text == f"<|im_start|>user\n{p.prompt_text}<|im_end|>\n<|im_start|>assistant\n"
        assert seq[0] == im_start and seq.count(im_end) == 1
    # raw message lists work too
    assert render_prompts([probs[0].messages], tiny_tokenizer) == ids[:1]


def test_render_prompts_without_chat_template(tiny_tokenizer):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        render_prompts(load_embedded("math", limit=1), tok)


# ---------------------------------------------------------------- rows checked before anything starts (issue #13)


def _verl_file(tmp_path, name, columns):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / name
    pq.write_table(pa.table(columns), f)
    return f


def _verl_columns(**over):
    cols = {
        "data_source": ["toy", "toy"],
        "prompt": [[{"role": "user", "content": "1+1?"}], [{"role": "user", "content": "2+2?"}]],
        "ability": ["math", "math"],
        "reward_model": [{"ground_truth": "2"}, {"ground_truth": "4"}],
        "extra_info": [{"index": 0}, {"index": 1}],
    }
    cols.update(over)
    return cols


def test_empty_data_files_raise_naming_the_file(tmp_path):
    import pyarrow as pa

    empty_json = tmp_path / "empty.json"
    empty_json.write_text("[]")
    with pytest.raises(ValueError, match="empty.json.*no problems"):
        load_leetcode_json(empty_json)
    with pytest.raises(ValueError, match="empty.json"):
        load_problems(str(empty_json))
    schema = pa.schema([("data_source", pa.string()), ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
                        ("ability", pa.string()), ("reward_model", pa.struct([("ground_truth", pa.string())]))])
    import pyarrow.parquet as pq

    f = tmp_path / "empty.parquet"
    pq.write_table(schema.empty_table(), f)
    with pytest.raises(ValueError, match="empty.parquet.*no rows"):
        load_verl_parquet(f)


@pytest.mark.parametrize("over,match", [
    ({"prompt": ["1+1?", "2+2?"]}, r"row 0: 'prompt' must be a list"),
    ({"prompt": [[{"role": "user"}], [{"role": "user"}]]}, r"row 0: prompt\[0\] has no 'content'"),
    ({"prompt": [[{"role": "user", "content": None}], [{"role": "user", "content": "x"}]]}, r"row 0: prompt\[0\]\.content is null"),
    ({"prompt": [[{"role": "user", "content": "x"}], []]}, r"row 1: 'prompt' is empty"),
    ({"reward_model": ["2", "4"]}, r"row 0: 'reward_model' must be a mapping"),
    ({"extra_info": [{"index": 7}, {"index": 7}]}, r"rows 0 and 1 share the problem id 'toy/7'"),
    ({"ability": ["code", "code"], "reward_model": [{"ground_truth": ""}, {"ground_truth": "x"}]}, r"row 0: a code row needs its tests"),
])
def test_bad_verl_rows_raise_one_line_naming_file_row_and_key(tmp_path, over, match):
    f = _verl_file(tmp_path, "rows.parquet", _verl_columns(**over))
    with pytest.raises(ValueError, match=match) as info:
        load_verl_parquet(f)
    assert "rows.parquet" in str(info.value) and "\n" not in str(info.value)


def test_good_verl_rows_still_load(tmp_path):
    f = _verl_file(tmp_path, "ok.parquet", _verl_columns())
    assert [p.problem_id for p in load_verl_parquet(f)] == ["toy/0", "toy/1"]


@pytest.mark.parametrize("row,match", [
    ({"problem": None, "tests": "x"}, r"row 0: 'problem' is null"),
    ({"tests": "x"}, r"row 0: no 'problem'"),
    ({"problem": "p"}, r"row 0: no 'tests'"),
    ({"problem": ["p"], "tests": "x"}, r"row 0: 'problem' must be a non-empty string"),
    ({"problem": "p", "tests": {"functional": "def check(:"}}, r"row 0: 'tests.functional' is not valid Python"),
    ("just a string", r"row 0: expected an object"),
])
def test_bad_leetcode_rows_raise_one_line_naming_file_row_and_key(tmp_path, row, match):
    f = tmp_path / "lc.json"
    f.write_text(json.dumps([row]))
    with pytest.raises(ValueError, match=match) as info:
        load_leetcode_json(f)
    assert "lc.json" in str(info.value) and "\n" not in str(info.value)


# ---- the benchmarks' cached trace


def test_the_default_trace_is_the_shipped_dsr_sub(tmp_path, monkeypatch):
    from integrations.data import trace

    monkeypatch.setenv("DAS_CACHE_DIR", str(tmp_path / "cache"))
    assert trace.default_trace_data() == "dsr_sub"
    assert trace.default_trace_path() == tmp_path / "cache" / "traces" / "dsr_sub_i5_p16_n8_t384.parquet"
    assert trace.default_trace_path(max_tokens=256).name == "dsr_sub_i5_p16_n8_t256.parquet"


def test_record_trace_runs_das_rollout_without_speculation(tmp_path, monkeypatch):
    from integrations.data import trace

    calls = []
    monkeypatch.setattr(trace.subprocess, "run", lambda cmd, check, cwd: calls.append((cmd, check, cwd)))
    out = trace.record_trace(tmp_path / "t.parquet", data="champ", model="/m", prompts=2)
    (cmd, check, cwd), = calls
    assert out == tmp_path / "t.parquet" and check and cwd == trace.REPO
    assert cmd[1:3] == ["-m", "integrations.rollout"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags == {"--data": "champ", "--method": "none", "--compare": "", "--iterations": "5", "--prompts": "2",
                     "--samples": "8", "--max-tokens": "384", "--trace": str(out), "--model": "/m"}


def test_cached_trace_names_a_missing_file(tmp_path, monkeypatch):
    from integrations.data import trace

    with pytest.raises(FileNotFoundError, match="no rollout trace at .*nope.parquet"):
        trace.cached_trace(tmp_path / "nope.parquet")
    monkeypatch.setenv("DAS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(trace, "record_trace", lambda *a, **k: pytest.fail("recorded"))
    with pytest.raises(FileNotFoundError, match="no rollout trace cached at"):
        trace.cached_trace(record=False)


@pytest.mark.parametrize("spec, name", [(None, "champ"), ("math", "champ"), ("HumanEval", "humaneval"), ("dsr", "dsr_sub"),
                                        ("leetcode", "leetcode"), ("../shared/data/dsr_sub.parquet", "dsr_sub"),
                                        ("/x/y/leetcode_train.json", "leetcode_train")])
def test_problem_set_name_is_short(spec, name):
    from integrations.data.problems import problem_set_name

    assert problem_set_name(spec) == name
