"""What the bench scripts share: their common command-line arguments and a deterministic synthetic prompt.

The scripts run as `python bench/NAME.py`, which puts bench/ on sys.path, so they import this as `bench_common`.
"""

from __future__ import annotations

import argparse

import torch

from harness.attribution.plan import attribution_variants
from harness.run.runner import RunSpec, VariantSpec
from optimized.registry import default_registry
from reference.config import ModelConfig, get_preset
from reference.weights.synthetic import SyntheticWeights


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


def bench_run_spec(args: argparse.Namespace, cfg: ModelConfig, ids: torch.Tensor, variants: str = "base,all",
                   reference_decode_together: bool | None = None, decode_sites_together: bool | None = None,
                   engine_decode_together: bool | None = None) -> RunSpec:
    """The lockstep spec the layer benches time: synthetic weights (seed 0), the first --tokens ids as the prompt
    in two turns, the rest decoded, one 16-token needle an eighth of the way in, the comma-separated patch sets
    `variants` ('base' or 'none': no patches; else a registry choice such as 'all'; 'attribution' alone: the 14
    variants `attribute` runs over the six built-in patches), local mode on."""
    ids_list = ids.tolist()
    turns = [0] * (len(ids_list) // 2) + [1] * (len(ids_list) - len(ids_list) // 2)
    chosen = attribution_variants(default_registry().choose("all")) if variants == "attribution" else \
        [VariantSpec(v, [] if v in ("base", "none") else default_registry().choose(v)) for v in variants.split(",")]
    return RunSpec(SyntheticWeights(cfg, 0), ids_list[: args.tokens], ids_list[args.tokens:], turns,
                   [(args.tokens // 8, args.tokens // 8 + 16)], chosen, local=True, device=args.device,
                   reference_decode_together=reference_decode_together, decode_sites_together=decode_sites_together,
                   engine_decode_together=engine_decode_together)
