"""A/B of one lockstep layer's wall time: this tree against older code, in alternating fresh processes (issue #14).

    python bench/ab_layer.py --against a60a928 --rounds 3 --model flash --tokens 30720 --decode 64 --device cuda
    python bench/ab_layer.py --old-tree /tmp/old ...      (a tree made by `git archive REV | tar -x -C /tmp/old`)

Each run is `bench/launch_count.py --time` of the tree (the layer once to warm up, then timed) in a process of its
own, old and new alternately, so that whatever drifts on the machine falls on both. On an H200 lease the same code's
layer took 12.2 to 15.9 s in successive processes (Flash CSA layer 2, 30,720 + 64 tokens): a change worth less than
that spread is only visible as a ratio of medians over alternating runs, never as two single figures. Prints each
run's wall seconds, the medians and new/old, with the device and thread count launch_count reports.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WALL = re.compile(r"([\d.]+) s wall")


def archived(rev: str, into: Path) -> Path:
    """The tree of git revision `rev` of this repository, extracted into `into`."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=False)
    if archive.returncode != 0:
        sys.exit(f"ab_layer: git archive {rev} failed: {archive.stderr.decode().strip()} (on a machine without the "
                 "repository's history, make the tree elsewhere and pass --old-tree)")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def layer_wall(tree: Path, args: list[str]) -> tuple[float, str]:
    """Wall seconds of the timed layer in `tree`, and launch_count's first line (model, layer, device, threads)."""
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{tree / 'bench'}"}
    done = subprocess.run([sys.executable, str(tree / "bench" / "launch_count.py"), "--time", *args], cwd=tree,
                          env=env, capture_output=True, text=True, check=False)
    head = done.stdout.splitlines()[0] if done.stdout else ""
    match = WALL.search(head)
    if done.returncode != 0 or match is None:
        sys.exit(f"ab_layer: launch_count in {tree} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return float(match[1]), head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    old = ap.add_mutually_exclusive_group(required=True)
    old.add_argument("--against", metavar="REV", help="git revision of this repository to compare with")
    old.add_argument("--old-tree", type=Path, metavar="DIR", help="a directory holding the older code")
    ap.add_argument("--rounds", type=int, default=3, help="old/new pairs (default 3)")
    args, passed = ap.parse_known_args()  # the rest goes to launch_count (--model, --tokens, --decode, --device, …)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = args.old_tree.resolve() if args.old_tree else archived(args.against, Path(tmp))
        walls: dict[str, list[float]] = {"old": [], "new": []}
        for round_ in range(1, args.rounds + 1):
            for name, tree in (("old", old_tree), ("new", ROOT)):
                wall, head = layer_wall(tree, passed)
                walls[name].append(wall)
                print(f"round {round_} {name}: {wall:.2f} s", flush=True)
    print(head.split(":")[0])
    medians = {name: statistics.median(w) for name, w in walls.items()}
    for name in ("old", "new"):
        print(f"  {name}: median {medians[name]:.2f} s of {', '.join(f'{w:.2f}' for w in walls[name])}")
    print(f"  new/old: {medians['new'] / medians['old']:.3f}")


if __name__ == "__main__":
    main()
