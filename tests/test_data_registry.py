"""Tests for integrations.data.registry: names to files and loaders, the shipped files, the data directory that
wins, the hub download (the hub client monkeypatched: nothing goes over the network), the one-line error
naming the download command, and ``python -m integrations.data``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from integrations.data import problems, registry
from integrations.data.problems import CODE_INSTRUCTION, load_leetcodedataset_jsonl, load_problems

REPO = Path(__file__).resolve().parents[1]

ROW = {"task_id": "two-sum", "question_id": 1, "difficulty": "Easy",
       "problem_description": "Given an array of integers nums and an integer target, return indices of the two numbers.",
       "starter_code": "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n        ",
       "entry_point": "Solution().twoSum",
       "test": "def check(candidate):\n    assert candidate(nums = [2,7,11,15], target = 9) == [0,1]\n",
       "completion": "class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n        for i, x in enumerate(nums):\n"
                     "            if target - x in seen:\n                return [seen[target - x], i]\n            seen[x] = i\n"}


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


class FakeHub:
    """``huggingface_hub.hf_hub_download`` as it behaves offline (nothing cached) and after a download."""

    def __init__(self, root: Path):
        self.root, self.calls, self.cached = root, [], None

    def __call__(self, repo_id, filename, *, repo_type=None, revision=None, local_files_only=False):
        self.calls.append((repo_id, filename, repo_type, revision, local_files_only))
        if local_files_only:
            if self.cached is None:
                raise FileNotFoundError("not in the cache")  # huggingface_hub raises LocalEntryNotFoundError here
            return str(self.cached)
        self.cached = _jsonl(self.root / filename, [ROW, {**ROW, "task_id": "add-two"}])
        return str(self.cached)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    import huggingface_hub

    fake = FakeHub(tmp_path)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake)
    return fake


def test_every_data_set_has_a_licence_a_kind_and_one_way_to_get_it():
    assert registry.names() == ["champ", "humaneval", "dsr_sub", "math500", "leetcode"]
    for d in registry.DATASETS:
        assert d.kind in ("math", "code") and d.reward == d.kind and d.licence and d.origin
        ways = [d.format == "embedded", d.shipped, d.hub is not None]
        assert sum(ways) == 1, d.name
        assert d.format in registry.FORMATS or d.format == "embedded"
        if d.shipped:
            assert registry.package_file(d) is not None, f"{d.file} is not shipped in integrations/data/files"
    assert registry.get("DSR") is registry.get("dsr_sub") and registry.lookup(None).name == "champ"
    with pytest.raises(ValueError, match="gsm8k.*'dsr_sub'"):
        registry.get("gsm8k")


def test_shipped_files_are_named_in_the_notice_and_in_package_data():
    notice = (registry.PACKAGE_FILES / "README.md").read_text()
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"integrations.data" = ["files/*.parquet", "files/README.md"]' in pyproject
    for d in registry.DATASETS:
        assert f"`{d.name}`" in notice or f"`{d.file}`" in notice, d.name
        if d.shipped:
            assert d.licence.split()[0] in notice
    ignored = subprocess.run(["git", "check-ignore", "-q", "integrations/data/files/dsr_sub.parquet"], cwd=REPO)
    assert ignored.returncode == 1, ".gitignore ignores the shipped parquet files"


def test_shipped_sets_load_without_a_data_dir():
    for name, rows in (("dsr_sub", 1209), ("math500", 500)):
        src = registry.resolve(name)
        assert src.path is not None and src.path.parent == registry.PACKAGE_FILES
        assert len(problems.load_source(src)) == rows


def test_the_data_dir_wins_and_only_for_files_it_has(tmp_path):
    import shutil

    shutil.copy(registry.PACKAGE_FILES / "math500.parquet", tmp_path / "math500.parquet")
    assert registry.resolve("math500", tmp_path).path == tmp_path / "math500.parquet"
    assert registry.resolve("dsr_sub", tmp_path).path.parent == registry.PACKAGE_FILES


def test_data_dir_from_env_is_read_only_where_asked(monkeypatch, tmp_path):
    monkeypatch.delenv(registry.DATA_ENV, raising=False)
    assert registry.data_dir_from_env() is None
    monkeypatch.setenv(registry.DATA_ENV, str(tmp_path))
    assert registry.data_dir_from_env() == tmp_path
    # the library itself ignores the variable: only a data_dir argument moves it
    (tmp_path / "dsr_sub.parquet").write_bytes(b"not parquet")
    assert registry.resolve("dsr_sub").path.parent == registry.PACKAGE_FILES


def test_a_missing_hub_set_names_the_command_in_one_line(hub, tmp_path):
    with pytest.raises(registry.DataNotFoundError) as info:
        registry.resolve("leetcode")
    msg = str(info.value)
    assert "python -m integrations.data download leetcode" in msg and "\n" not in msg
    with pytest.raises(FileNotFoundError, match=f"DAS_DATA_DIR={tmp_path} has no leetcode_train.json"):
        registry.resolve("leetcode", tmp_path)
    assert all(c[-1] for c in hub.calls), "resolving must never download"


def test_download_fetches_the_pinned_file_and_the_loader_reads_it(hub):
    path = registry.download("leetcode")
    d = registry.get("leetcode")
    assert hub.calls[-1] == (d.hub.repo_id, d.hub.filename, "dataset", d.hub.revision, False)
    src = registry.resolve("leetcode")
    assert src.path == path and src.format == "leetcodedataset-jsonl"
    probs = load_problems("leetcode")
    assert [p.problem_id for p in probs] == ["leetcode/two-sum", "leetcode/add-two"]
    p = probs[0]
    assert p.kind == "code" and p.source == "leetcode" and p.prompt_text.startswith(CODE_INSTRUCTION)
    assert "class Solution" in p.prompt_text and p.tests.rstrip().endswith("check(Solution().twoSum)")
    r = subprocess.run([sys.executable, "-c", p.test_program(p.answer)], capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert registry.download("dsr_sub") == registry.PACKAGE_FILES / "dsr_sub.parquet"  # shipped: nothing fetched
    with pytest.raises(ValueError, match="nothing to download"):
        registry.download("champ")


def test_a_failed_download_says_what_was_asked(monkeypatch):
    import huggingface_hub

    def offline(*a, **k):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(RuntimeError, match="newfacade/LeetCodeDataset/LeetCodeDataset-train.jsonl.*no network"):
        registry.download("leetcode")


def test_leetcodedataset_jsonl_errors_name_the_line(tmp_path):
    f = _jsonl(tmp_path / "lc.jsonl", [ROW, {**ROW, "test": ""}])
    with pytest.raises(ValueError, match="lc.jsonl' line 2: 'test'"):
        load_leetcodedataset_jsonl(f)
    assert len(load_leetcodedataset_jsonl(f, limit=1)) == 1
    with pytest.raises(ValueError, match="share the task_id"):
        load_leetcodedataset_jsonl(_jsonl(tmp_path / "dup.jsonl", [ROW, ROW]))


def test_paths_are_read_by_their_suffix(tmp_path):
    f = _jsonl(tmp_path / "mine.jsonl", [ROW])
    assert registry.resolve(f).format == "leetcodedataset-jsonl"
    with pytest.raises(ValueError, match=r"problems.csv.*\.parquet, \.json, \.jsonl"):
        registry.resolve(tmp_path / "problems.csv")


def test_the_cli_lists_and_downloads(hub, capsys):
    from integrations.data.__main__ import main

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "dsr_sub" in out and "MIT" in out and "python -m integrations.data download leetcode" in out
    assert main(["download", "leetcode"]) == 0
    assert capsys.readouterr().out.strip().endswith("LeetCodeDataset-train.jsonl")


def test_das_grpo_reads_das_data_dir_at_its_entry_point(tmp_path, monkeypatch):
    import argparse
    import shutil

    from integrations.rl.grpo import check_recipe

    p = argparse.ArgumentParser(prog="das-grpo")
    args = argparse.Namespace(recipe="grpo_dsr_sub", overrides=["data=math500", "log.json=null"], overwrite=False, compare=None)
    monkeypatch.delenv(registry.DATA_ENV, raising=False)
    assert check_recipe(p, args).data == "math500"  # the shipped copy: the name stays
    shutil.copy(registry.PACKAGE_FILES / "math500.parquet", tmp_path / "math500.parquet")
    monkeypatch.setenv(registry.DATA_ENV, str(tmp_path))
    assert check_recipe(p, args).data == str(tmp_path / "math500.parquet")  # the local copy wins, passed on as a path
