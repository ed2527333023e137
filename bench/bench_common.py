"""What the bench scripts share: their common command-line arguments and a deterministic synthetic prompt.

The scripts run as `python bench/NAME.py`, which puts bench/ on sys.path, so they import this as `bench_common`.
"""

from __future__ import annotations

import argparse

import torch

from reference.config import ModelConfig, get_preset


def bench_parser(doc: str, tokens: int) -> argparse.ArgumentParser:
    """--model, --tokens, --decode, --device; the caller adds its own."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--model", default="flash-mini")
    ap.add_argument("--tokens", type=int, default=tokens)
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    return ap


def bench_setup(args: argparse.Namespace) -> tuple[ModelConfig, torch.Tensor]:
    """The preset and tokens + decode ids drawn (seed 0) from ordinary vocabulary ids, clear of special tokens;
    fp32 matmuls at full precision, as the reference requires."""
    torch.set_float32_matmul_precision("highest")
    cfg = get_preset(args.model)
    ids = torch.randint(min(1000, cfg.vocab_size // 2), min(cfg.vocab_size, 100000), (args.tokens + args.decode,),
                        generator=torch.Generator().manual_seed(0))
    return cfg, ids
