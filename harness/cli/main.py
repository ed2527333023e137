"""`dsv4-drift`: one verb per job over one shared argument model (see README, CLI)."""

from __future__ import annotations

import argparse
import sys

import torch

from harness.errors import UsageError


def build_parser() -> argparse.ArgumentParser:
    from harness.cli.commands import attribute, checkpoint, forward, gate, patches, report, run, scenarios, selftest

    parser = argparse.ArgumentParser(
        prog="dsv4-drift",
        description="Differential numerical-correctness harness for DeepSeek-V4: a pure-fp32 reference and an "
                    "optimized low-precision stack, compared layer by layer.",
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
    return parser


def main(argv: list[str] | None = None) -> int:
    # The reference is pure fp32: no TF32 anywhere (DESIGN §3); the reference also asserts this itself.
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"dsv4-drift {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
