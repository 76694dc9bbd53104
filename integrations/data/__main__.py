"""``python -m integrations.data``: list the named data sets, or download one into the Hugging Face hub cache.

    python -m integrations.data list               # every data set: where it is read from, its licence
    python -m integrations.data download leetcode  # fetch a hub data set (needs network)
"""

from __future__ import annotations

import argparse
import sys

from integrations.data import registry


def _where(d: registry.DataSet, data_dir) -> str:
    try:
        src = registry.resolve(d.name, data_dir)
    except FileNotFoundError:
        return f"not downloaded: {registry.DOWNLOAD_COMMAND.format(name=d.name)}"
    return "installed package" if src.path is None else str(src.path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m integrations.data", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="every data set: kind, rows, licence, where it is read from ($DAS_DATA_DIR first)")
    dl = sub.add_parser("download", help="fetch a data set into the Hugging Face hub cache (needs network)")
    dl.add_argument("name", choices=registry.names())
    args = p.parse_args(argv)
    data_dir = registry.data_dir_from_env()
    if args.command == "list":
        from tabulate import tabulate

        rows = [[d.name, d.kind, d.rows if d.rows is not None else "-", d.licence, _where(d, data_dir)] for d in registry.DATASETS]
        print(tabulate(rows, ["name", "kind", "rows", "licence", "read from"]))
        return 0
    try:
        path = registry.download(args.name)
    except (ValueError, RuntimeError) as exc:
        print(f"python -m integrations.data: error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
