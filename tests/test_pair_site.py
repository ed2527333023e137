"""The MoE pair site (`moe.pair_site_loss` on taps `moe.experts.site`, `moe.shared.site`; default policy check
`moe-pair-site`) fails experts that lose, repeat or misweigh a whole pair's contribution, and passes experts that
compute every pair in low precision.

Expert-parallel dispatch with a fixed buffer per expert, and MoE kernels with a capacity factor, drop the pairs past
it: a few tokens per layer lose one expert's output, which the MoE's mean error hides (on the CPU demo a capacity
factor of 1.25 failed one unit of `moe-out-rel-l2-patch`, by 6%, and one of `attn-lse-delta-patch` at layer 41). The site fits the variant's move from the stock
op's output, per token, by the stock op's own pair outputs (optimized.engine.pair_sites).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from optimized.engine import OptimizedModel, expert_site_bias, pair_sites
from optimized.patching import Patch, PatchChoice
from optimized.registry import default_registry
from reference.config import TINY
from reference.model import segment_lengths
from reference.weights.synthetic import SyntheticWeights

SITES = ("moe.experts.site", "moe.shared.site")


def pair_site_loss(out: torch.Tensor, stock: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """The pair site's per-token flags alone."""
    return pair_sites(out, stock, pairs)[0]


def bias(out: torch.Tensor, stock: torch.Tensor, pairs: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor:
    """expert_site_bias of the coefficients pair_sites gives, as the engine takes them."""
    return expert_site_bias(pair_sites(out, stock, pairs)[1], ids, n)


def test_pair_site_loss_flags_a_pair_lost_repeated_or_misweighted_by_half_not_rounding():
    """Unit cases on random pairs (k = 3, D = 64): a token counts where a pair's coefficient |a| exceeds 3/4 and its
    own part of the fit stands 8× (in norm) above the fit's residual."""
    g = torch.Generator().manual_seed(0)
    pairs = torch.randn(7, 3, 64, generator=g)
    stock = pairs.sum(1)
    out = stock.clone()
    out[0] -= pairs[0, 1]  # a pair lost
    out[1] += pairs[1, 2]  # a pair counted twice
    out[2] = 0  # the token lost all its pairs (a dispatch that dropped it)
    noise = torch.randn(64, generator=g)
    out[3] += 0.2 * noise / noise.norm() * stock[3].norm()  # a kernel's rounding, 20% of the output: no pair's move
    out[4] -= 0.6 * pairs[4, 0]  # a pair's weight 60% low: within what W4A4 rounding reaches (0.74)
    out[5] -= 0.8 * pairs[5, 0]  # 80% low: counted
    small = pairs[6].clone()
    small[1] *= 0.05  # a pair at 5% of the others, dropped under rounding error 20× its size: not identifiable
    out[6] = small.sum(0) - small[1] + 0.2 * noise / noise.norm() * small.sum(0).norm()
    got = pair_site_loss(out, torch.cat([stock[:6], small.sum(0, keepdim=True)]),
                         torch.cat([pairs[:6], small[None]]))
    assert got.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0], got
    assert pair_site_loss(stock, stock, pairs).tolist() == [0.0] * 7
    twins = torch.randn(2000, 3, 64, generator=g)
    twins[:, 1] = twins[:, 0] + 1e-3 * torch.randn(2000, 64, generator=g)  # two nearly collinear pairs, one dropped:
    twin_stock = twins.sum(1)  # the Gram matrices' own rounding must stay below what tells them apart (fp64)
    assert pair_site_loss(twin_stock - twins[:, 0], twin_stock, twins).mean() == 1.0
    assert pair_site_loss(torch.zeros(0, 64), torch.zeros(0, 64), torch.zeros(0, 3, 64)).shape == (0,)
    zero = pairs.clone()
    zero[:, 2] = 0  # a pair whose output is zero (a zero routing weight): no move is its, nothing breaks
    assert pair_site_loss(zero.sum(1), zero.sum(1), zero).tolist() == [0.0] * 7


def test_expert_site_bias_flags_an_expert_scaled_at_most_of_its_pairs():
    """Unit cases (4 experts, k = 3 of them per token, D = 32): rounding-like noise on every token flags nothing; one
    expert's pairs halved flags exactly the tokens routed to it; an expert with 15 pairs is not judged; a minority
    of an expert's pairs lost moves its median by nothing."""
    g = torch.Generator().manual_seed(0)
    pairs = torch.randn(400, 3, 32, generator=g)
    stock = pairs.sum(1)
    ids = torch.stack([torch.randperm(4, generator=g)[:3] for _ in range(400)])
    noisy = stock + 0.05 * stock.norm(dim=-1, keepdim=True) * torch.randn(400, 32, generator=g) / 32 ** 0.5
    assert bias(noisy, stock, pairs, ids, 4).sum() == 0
    routed = (ids == 2).float()
    halved = stock - 0.5 * (pairs * routed[..., None]).sum(1)
    assert torch.equal(bias(halved, stock, pairs, ids, 4), routed.amax(-1))
    few = (ids == 2).any(-1).nonzero().squeeze(-1)[15:]  # keep only 15 of expert 2's tokens
    keep = torch.ones(400, dtype=torch.bool)
    keep[few] = False
    assert bias(halved[keep], stock[keep], pairs[keep], ids[keep], 4).sum() == 0
    lost = stock.clone()
    minority = (ids == 1).any(-1).nonzero().squeeze(-1)[::3]  # a third of expert 1's tokens lose its pair
    lost[minority] -= (pairs[minority] * (ids[minority] == 1).float()[..., None]).sum(1)
    assert bias(lost, stock, pairs, ids, 4).sum() == 0
    one = torch.zeros(64, 1, dtype=torch.long)  # one expert, 64 pairs: half of them scaled up or down is no majority
    for sign in (1, -1):
        moved = pairs[:64].sum(1).clone()
        moved[:32] += sign * 0.5 * pairs[:32, 0]
        assert bias(moved, pairs[:64].sum(1), pairs[:64, :1], one, 1).sum() == 0, sign
        moved[32] += sign * 0.5 * pairs[32, 0]
        assert bias(moved, pairs[:64].sum(1), pairs[:64, :1], one, 1).sum() == 64, sign


class _LossSink:
    """Keeps the pair site's and the expert site's per-token flags, per tap and position."""

    def __init__(self, field: str = "lost") -> None:
        self.field = field
        self.lost: dict[str, dict[int, float]] = {tap: {} for tap in SITES}

    def wants(self, tap: str) -> bool:
        return tap in self.lost

    def sampled(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(positions, dtype=torch.bool)

    def emit(self, tap: str, positions: torch.Tensor, **values: torch.Tensor) -> None:
        self.lost[tap].update(zip(positions.tolist(), values[self.field].tolist()))


def _loss_rates(choices: list[PatchChoice], decode: int = 4, field: str = "lost") -> dict[str, dict[str, float]]:
    """Share of tokens each site flags in `field`, prefill and decode apart, over tiny's five layers (96 prompt
    tokens in one chunk, `decode` steps), each layer on the stock engine's input."""
    source = SyntheticWeights(TINY, 0)
    stock, model = OptimizedModel(source, []), OptimizedModel(source, choices)
    n = 96 + decode
    ids = torch.randint(0, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(11))
    segments, x = segment_lengths(96, decode, 96), stock.embed(ids)
    flags: dict[str, dict[str, list[float]]] = {tap: {"prefill": [], "decode": []} for tap in SITES}
    for layer in range(TINY.num_hidden_layers):
        sink = _LossSink(field)
        model.run_layer(model.layer(layer), x, ids, segments, 96, sink)
        x = stock.run_layer(stock.layer(layer), x, ids, segments, 96)
        for tap, by_position in sink.lost.items():
            assert not by_position or len(by_position) == n, (tap, len(by_position))  # every token emitted once
            for p, v in by_position.items():
                flags[tap]["prefill" if p < 96 else "decode"].append(v)
    return {tap: {ph: sum(v) / len(v) if v else 0.0 for ph, v in d.items()} for tap, d in flags.items()}


def _patch(name: str, op: str, fn, phases=("prefill", "decode")) -> PatchChoice:
    patch = Patch(name, phases, name)
    patch.op(op)(fn)
    return PatchChoice(patch, {})


def _capacity(ctx, y, routing):
    ids = routing.expert_ids
    cap = math.ceil(1.25 * ids.numel() / ctx.cfg.n_routed_experts)
    onehot = torch.nn.functional.one_hot(ids.flatten(), ctx.cfg.n_routed_experts)
    kept = ((onehot.cumsum(0) * onehot).sum(-1) - 1 < cap).view(ids.shape)
    return ctx.base(y=y, routing=dataclasses.replace(routing, weights=routing.weights * kept))


def test_the_pair_site_fails_experts_that_drop_or_repeat_pairs_and_passes_correct_ones():
    """Measured on tiny (five layers, 96 prefill tokens, 4 decode steps): the stock ops, a plugin that calls ctx.base
    and the W4A4 experts of nvfp4-experts (their error is ~18% of the output per token, in norm) are flagged at no
    token; a capacity factor of 1.25 at some prefill tokens (not in decode: one token a step fits any capacity); a
    shared expert left out at every token; a decode kernel that adds its first slot twice at every decode step."""
    zero = {tap: {"prefill": 0.0, "decode": 0.0} for tap in SITES}
    assert _loss_rates([]) == zero
    assert _loss_rates([_patch("through", "experts", lambda ctx, y, routing: ctx.base(y=y, routing=routing))]) == zero
    assert _loss_rates(default_registry().choose("nvfp4-experts")) == zero
    cap = _loss_rates([_patch("capacity", "experts", _capacity)])
    assert cap["moe.experts.site"]["prefill"] > 0.01 and cap["moe.experts.site"]["decode"] == 0, cap
    assert cap["moe.shared.site"] == zero["moe.shared.site"], cap
    shared = _loss_rates([_patch("no-shared", "shared_expert", lambda ctx, y, routing: torch.zeros_like(y))])
    assert shared["moe.shared.site"] == {"prefill": 1.0, "decode": 1.0}, shared

    def twice(ctx, y, routing):
        only_first = torch.zeros_like(routing.weights)
        only_first[:, 0] = 1
        first = dataclasses.replace(routing, weights=routing.weights * only_first)
        return ctx.base(y=y, routing=routing) + ctx.base(y=y, routing=first)

    doubled = _loss_rates([_patch("first-twice", "experts", twice, ("decode",))])
    assert doubled["moe.experts.site"] == {"prefill": 0.0, "decode": 1.0}, doubled


def test_the_expert_site_fails_an_expert_loaded_at_half_scale_and_passes_correct_experts():
    """On tiny (five layers, 96 prefill tokens): a loader that dequantizes expert 0's w2 at half its scale is flagged
    at the tokens routed to expert 0, in prefill (4 decode steps give expert 0 fewer than 16 pairs); the stock ops
    and the W4A4 experts of nvfp4-experts at none; the pair site does not see the half (a = −1/2 < 3/4)."""
    zero = {tap: {"prefill": 0.0, "decode": 0.0} for tap in SITES}
    assert _loss_rates([], field="biased") == zero
    assert _loss_rates(default_registry().choose("nvfp4-experts"), field="biased") == zero

    def half(ctx, name, fmt):
        w = ctx.base(name=name, fmt=fmt)
        return w * 0.5 if name == "ffn.experts.0.w2.weight" else w

    choice = _patch("expert-0-half", "load_weight", half)
    biased = _loss_rates([choice], field="biased")
    assert 0.05 < biased["moe.experts.site"]["prefill"] < 0.9 and biased["moe.shared.site"] == zero["moe.shared.site"]
    assert _loss_rates([choice])["moe.experts.site"]["prefill"] == 0.0, "the pair site's share is 3/4"
