"""Put the table of a `dsv4-drift bench --json` file into README.md's Benchmarks section (issue #14: the section is
regenerated from bench's output, not retyped).

    python bench/readme_table.py BENCH.json [--readme README.md] [--print]

The table goes between the README's two marker lines (BEGIN and END below), replacing what stood there; everything
else in the file is left as it was. `--print` writes the table to stdout instead. A JSON file that is not bench's,
or a README without exactly one pair of markers in order, is an error naming the file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from harness.cli.commands.bench import bench_markdown  # noqa: E402

BEGIN = "<!-- bench-table: begin (bench/readme_table.py writes what follows, from `dsv4-drift bench --json`) -->"
END = "<!-- bench-table: end -->"


def read_record(path: Path) -> dict:
    """The bench record in `path`, or SystemExit naming the file and what is missing."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path}: not a readable JSON file ({e})") from None
    missing = [k for k in ("model", "tokens", "decode", "layers", "fp32_peak_flops") if k not in record]
    if missing or not isinstance(record.get("layers"), list) or not record["layers"]:
        raise SystemExit(f"{path}: not the output of `dsv4-drift bench --json` (missing {missing or ['layers']})")
    return record


def with_table(readme: str, table: str, where: Path) -> str:
    """`readme` with the text between its markers replaced by `table`."""
    if readme.count(BEGIN) != 1 or readme.count(END) != 1 or readme.index(BEGIN) > readme.index(END):
        raise SystemExit(f"{where}: needs exactly one line {BEGIN!r} and, after it, one line {END!r}")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench_json", type=Path, help="a file written by `dsv4-drift bench --json`")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    parser.add_argument("--print", action="store_true", help="write the table to stdout, change no file")
    args = parser.parse_args(argv)
    record = read_record(args.bench_json)
    table = bench_markdown(record)
    if args.print:
        sys.stdout.write(table)
        return 0
    try:
        readme = args.readme.read_text()
    except OSError as e:
        raise SystemExit(f"{args.readme}: cannot read it ({e})") from None
    args.readme.write_text(with_table(readme, table, args.readme))
    print(f"{args.readme}: bench table from {args.bench_json} ({len(record['layers'])} layers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
