"""The attention and indexer sites catch a kernel that attends, or a selection that keeps, something other than the
spec says — for that reason, not for the size of its drift (default policy, rule 6).

Bug shapes from serving stacks, written as plugins against the README's API: a decode window one row short (the
oldest of the 128 rows dropped), an indexer that loses the best-scoring pick (as a stale page table loses the newest
rows), an indexer whose causal mask is one row late, hc_post contracting the wrong index of its comb, compressed
rows written out of order and window rows read from the slot before, and the fused hash routing run without its
scaling factor. The split-K decode kernel (mma-sparse-decode: bf16 partials, fp32 LSE
merge), hash-topk with its scale and hc_post summed in another order are correct and must pass.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from harness.cli.main import main

BUGS = '''
import dataclasses

import torch
from optimized.patching import Patch

short_window = Patch("short-window", phases=("decode",), description="the decode window keeps 127 rows")


@short_window.op("sparse_attention")
def attend(ctx, q, window_slots, comp_slots, sink):
    oldest = torch.where(window_slots >= 0, window_slots, 2**62).argmin(1, keepdim=True)
    return ctx.base(q=q, window_slots=window_slots.scatter(1, oldest, -1), comp_slots=comp_slots, sink=sink)


lose_best = Patch("lose-best-pick", phases=("decode",), description="the indexer drops its best-scoring pick")


@lose_best.op("indexer_topk")
def topk(ctx, logits, positions, k):
    row_ids, valid = ctx.base(logits=logits, positions=positions, k=k)
    best = torch.where(valid, logits.gather(1, row_ids), float("-inf")).argmax(1, keepdim=True)
    return row_ids, valid.scatter(1, best, False)


future_row = Patch("future-row", phases=("prefill", "decode"),
                   description="the indexer's causal mask one row late: a query may pick the row still being pooled")


@future_row.op("indexer_logits")
def logits(ctx, q, weights, positions):
    return ctx.base(q=q, weights=weights, positions=positions + ctx.state.ratio)


@future_row.op("indexer_topk")
def late_topk(ctx, logits, positions, k):
    return ctx.base(logits=logits, positions=positions + ctx.state.ratio, k=k)


comb_transposed = Patch("comb-transposed", phases=("prefill", "decode"),
                        description="hc_post contracts the second index of C (C·X instead of Cᵀ·X)")


@comb_transposed.op("hc_post")
def transposed(ctx, f, streams, mix):
    return ctx.base(f=f, streams=streams, mix=dataclasses.replace(mix, comb=mix.comb.transpose(-1, -2)))


post_reordered = Patch("post-reordered", phases=("prefill", "decode"),
                       description="hc_post as a fused kernel might sum it: streams last to first, post·f last, "
                                   "fused multiply-adds, then the bf16 store")


@post_reordered.op("hc_post")
def reordered(ctx, f, streams, mix):
    x = streams.float()
    acc = torch.zeros_like(x)
    for j in reversed(range(x.shape[-2])):
        acc = torch.addcmul(acc, mix.comb[..., j, :].unsqueeze(-1), x[..., j:j + 1, :])
    return torch.addcmul(acc, mix.post.unsqueeze(-1), f.float().unsqueeze(-2)).to(torch.bfloat16)


rows_reversed = Patch("rows-reversed", phases=("prefill",),
                      description="a prefill chunk's compressed rows written in reverse order")


@rows_reversed.op("kv_store")
def reversed_rows(ctx, cache, rows):
    return ctx.base(cache=cache, rows=rows.flip(0) if cache == "compressed" else rows)


read_one_early = Patch("read-one-early", phases=("decode",),
                       description="decode reads each window row from the slot before it")


@read_one_early.op("kv_load")
def one_early(ctx, cache, slots):
    return ctx.base(cache=cache, slots=torch.where((slots > 0) & (cache == "window"), slots - 1, slots))
'''

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "tiny-smoke.yaml"


def _verdicts(tmp_path: Path) -> dict[str, dict[str, str]]:
    plugin = tmp_path / "bugs.py"
    plugin.write_text(BUGS)
    scenario = yaml.safe_load(SCENARIO.read_text())
    scenario["name"] = "site-checks"
    scenario["stacks"]["variants"] = [{"name": n, "patches": p} for n, p in (
        ("base", []), ("mma", ["mma-sparse-decode"]), ("short-window", ["short-window"]),
        ("lose-best", ["lose-best-pick"]), ("hash-topk", ["hash-topk"]), ("future-row", ["future-row"]),
        ("comb-transposed", ["comb-transposed"]), ("post-reordered", ["post-reordered"]),
        ("rows-reversed", ["rows-reversed"]), ("read-one-early", ["read-one-early"]))] + [
        {"name": "unscaled", "patches": ["hash-topk"], "options": {"hash-topk": {"scale_on": "none"}}}]
    path = tmp_path / "site-checks.yaml"
    path.write_text(yaml.safe_dump(scenario, sort_keys=False))
    out = tmp_path / "run"
    assert main(["run", str(path), "--patch-module", str(plugin), "--out", str(out), "--no-report",
                 "--no-triage"]) == 1
    gate = json.loads((out / "gate.json").read_text())
    return {c["name"]: {v["variant"]: v["status"] for v in c["variants"]} for c in gate["checks"]
            if c["name"] in ("attn-site", "indexer-site-margin", "indexer-site-future", "router-weight-site",
                             "mhc-post-site", "kv-cache-site")}


def test_site_checks_fail_the_bugs_and_pass_the_correct_kernels(tmp_path):
    verdicts = _verdicts(tmp_path)
    correct = {"base": "pass", "mma": "pass", "hash-topk": "pass"}
    # a cache row written out of order or read from the slot before its own reads back other than its stored form;
    # the attention site runs the stock attention on the same cache and cannot see either
    cache_bugs = {"rows-reversed": "fail", "read-one-early": "fail"}
    others = {"short-window": "pass", "lose-best": "pass", "unscaled": "pass", "future-row": "pass",
              "comb-transposed": "pass", "post-reordered": "pass"}
    assert verdicts.pop("kv-cache-site") == {**correct, **others, **cache_bugs}
    for check in verdicts.values():  # what the other checks make of them is theirs (drift past base, or none)
        for bug in cache_bugs:
            check.pop(bug)
    # a row leaked past the causal mask is picked only if it scores among the top k, and before k rows are visible
    # it displaces nothing: the recall checks need not see it; the causality check sees every such pick
    assert verdicts["indexer-site-future"] == {**correct, "short-window": "pass", "lose-best": "pass",
                                               "unscaled": "pass", "future-row": "fail", "comb-transposed": "pass",
                                               "post-reordered": "pass"}
    # hc_post contracting the wrong index of C moves its outputs past any fp32 rounding of the stock math, yet its
    # drift hides in base's (the synthetic streams are a few % apart, and C and Cᵀ mix near-equal streams alike);
    # the same math summed in another order, with fused multiply-adds, stays within it
    assert verdicts["mhc-post-site"] == {**correct, "short-window": "pass", "lose-best": "pass", "unscaled": "pass",
                                         "future-row": "pass", "comb-transposed": "fail", "post-reordered": "pass"}
    for check in verdicts.values():
        for added in ("future-row", "comb-transposed", "post-reordered"):
            check.pop(added)
    assert verdicts["attn-site"] == {**correct, "short-window": "fail", "lose-best": "pass", "unscaled": "pass"}
    assert verdicts["indexer-site-margin"] == {**correct, "short-window": "pass", "lose-best": "fail",
                                               "unscaled": "pass"}
    # hash-topk moves routed_scaling_factor onto the MoE output: the weights each expert gets are the stock's; a
    # runner that never applies it (scale_on: none, the failure the spec warns about) is off by 1/1.5
    assert verdicts["router-weight-site"] == {**correct, "short-window": "pass", "lose-best": "pass",
                                              "unscaled": "fail"}
