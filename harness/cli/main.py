"""`dsv4-drift`: one verb per job over one shared argument model (see README, CLI).

Exit codes, the same for every command (CI tells a regression from a broken pipeline by them):
0 success / the gate passes, 1 a regression (the gate fails), 2 a usage or input error (a file, flag, field or
tensor is wrong, an output cannot be written, an incomplete run is gated), 3 a patch's op raised (a fault inside a
plugin or built-in patch; the run is marked failed), 4 an internal error of dsv4-drift itself (with its
traceback), 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
import traceback

import torch

from harness.errors import UsageError
from harness.run.distributed import RankFailed
from harness.run.host_allocator import keep_freed_host_memory
from optimized.patching import PluginOpError

EXIT_CODES = {0: "success (the gate passes)", 1: "regression (the gate fails)", 2: "usage or input error",
              3: "a patch's op raised (plugin fault)", 4: "internal error", 130: "interrupted"}


def build_parser() -> argparse.ArgumentParser:
    from harness.cli.commands import attribute, bench, checkpoint, forward, gate, patches, report, run, scenarios, \
        selftest

    parser = argparse.ArgumentParser(
        prog="dsv4-drift",
        description="Differential numerical-correctness harness for DeepSeek-V4: a pure-fp32 reference and an "
                    "optimized low-precision stack, compared layer by layer.",
        epilog="exit codes: " + "; ".join(f"{code} {meaning}" for code, meaning in EXIT_CODES.items()),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run.add_parser(sub)
    forward.add_parser(sub)
    scenarios.add_parser(sub)
    report.add_parser(sub)
    gate.add_parser(sub)
    patches.add_parser(sub)
    checkpoint.add_parser(sub)
    attribute.add_parser(sub)
    selftest.add_parser(sub)
    bench.add_parser(sub)
    return parser


def run_command(args: argparse.Namespace) -> int:
    """A parsed command's function, run as every entry point runs it (`main`, the pytest plugin's `run`). The
    reference is pure fp32: no TF32 anywhere (DESIGN §3; the reference also asserts this itself). Nothing here
    differentiates: inference mode skips autograd's and view tracking's dispatch on every tensor operation (~0.5 µs
    each of a few µs; a run is bound by their number: README, What keeps a layer fast). The same kernels run: the
    numbers do not change."""
    keep_freed_host_memory()  # glibc: reuse freed tensors' pages instead of faulting them in anew (host_allocator)
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with torch.inference_mode():
        return int(args.func(args) or 0)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return run_command(args)
    except UsageError as e:
        print(f"dsv4-drift {args.command}: error: {e}", file=sys.stderr)
        return 2
    except PluginOpError as e:
        print(f"dsv4-drift {args.command}: plugin fault: {e}", file=sys.stderr)
        return 3
    except RankFailed as e:  # a rank of a sharded run (its own traceback is above)
        print(f"dsv4-drift {args.command}: {e}", file=sys.stderr)
        return 3 if e.plugin_fault else 2 if e.input_fault else 4
    except OSError as e:  # a file or directory the command reads or writes (disk full, permissions)
        where = f"{e.filename}: " if e.filename else ""
        print(f"dsv4-drift {args.command}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - a bug of ours must not read as a regression (exit 1) in CI
        traceback.print_exc()
        print(f"dsv4-drift {args.command}: internal error (a bug in dsv4-drift, please report it with the traceback "
              f"above): {type(e).__name__}: {e}", file=sys.stderr)
        return 4


if __name__ == "__main__":
    sys.exit(main())
