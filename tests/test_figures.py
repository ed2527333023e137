"""Figures (`dsv4-drift report RUN_DIR --figures`): each view drawn from a synthetic 43-layer run that carries the
gate's own gate.json (the shipped default policy, evaluated on it) and an attribution.json — checked for its
panels, labels, scales and numbers (the HTML page's), and written as non-blank PNGs and byte-stable SVGs."""

from __future__ import annotations

import json
import math
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import matplotlib.image
import numpy as np
import pyarrow.parquet as pq
import pytest
from matplotlib.colors import LogNorm, TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from harness.cli.main import main
from harness.errors import UsageError
from harness.gate.gate_run import gate_run
from harness.gate.outputs import FIGURES_DIR, markdown
from harness.report.data import pack_row, unpack_row
from harness.report.figures import (DPI, KIND_COLOURS, VIEWS, WIDTH_IN, FigureData, NothingToDraw, _boundary_marks,
                                    attribution, context_loss, drift_vs_layer, heatmap, variant_style, write_figures)
from harness.report.synthetic import BAD_FROM_LAYER, BAD_PATCH, PATCHES, write_synthetic_run
from harness.run.store import RunStore

FAMILY_ROWS = [("Hidden streams", "stream rel L2"), ("Attention", "attention TV"),
               ("Indexer top-k", "indexer recall@k"), ("mHC (hyper-connections)", "mHC comb rel err (attn.hc)"),
               ("MoE routing", "MoE expert flip rate"), ("Final logits", "logits KL")]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """43 layers (flash schedule), 4K prompt tokens (a preamble and six turns) prefilled in two chunks, 8 decode
    steps; variants base, mma-sparse-decode, triton-indexer (goes wrong in decode from layer 4) and all."""
    run = write_synthetic_run(tmp_path_factory.mktemp("figures") / "run", n_prompt=4096, n_decode=8, chunk_size=2048,
                              bin_size=512, n_single_patch_variants=2, gate=False)
    gate_run(run)  # gate.json as the gate writes it: per-layer units, checks on layer means
    return run


@pytest.fixture(scope="module")
def data(run_dir: Path) -> FigureData:
    return FigureData.load(run_dir)


def small_run(path: Path, **kwargs) -> Path:
    """The tiny preset (5 layers), two prefill chunks, two decode steps, one patched variant; no gate."""
    return write_synthetic_run(path, preset="tiny", n_prompt=256, n_decode=2, chunk_size=128, bin_size=64,
                               n_single_patch_variants=1, gate=False, **kwargs)


def line(ax, label: str):
    found = [ln for ln in ax.get_lines() if ln.get_label() == label]
    assert len(found) == 1, f"expected one line labelled {label!r} in {ax.get_title()!r}, found {len(found)}"
    return found[0]


def page_means(data: FigureData, variant: str, key: str, phase: str) -> dict[int, float]:
    """The HTML page's per-layer means (payload table), keyed by layer, for the layers that have one."""
    values = data.payload["table"]["global"][variant][key][phase]["mean"]
    return {layer: v for layer, v in enumerate(values) if v is not None}


def gate_limits(run_dir: Path, metric: str, variant: str, phase: str) -> dict[int, float]:
    """Straight from gate.json: per layer, the tightest limit of the checks on layer means, in loss units."""
    limits: dict[int, float] = {}
    for check in json.loads((run_dir / "gate.json").read_text())["checks"]:
        if check["metric"] != metric or check["aggregate"] != "mean":
            continue
        for result in check["variants"]:
            for u in result["units"]:
                if (u["variant"], u["phase"], u["mode"]) == (variant, phase, "global"):
                    limits[u["layer"]] = min(limits.get(u["layer"], math.inf), u["limit"])
    return limits


def ink(png: Path) -> float:
    """The share of a PNG's pixels that are not white: 0 for a blank canvas."""
    pixels = matplotlib.image.imread(png)[..., :3]
    return float((pixels < 0.97).any(axis=-1).mean())


# ----------------------------------------------------------------------------------------------


def test_packed_heatmap_rows_read_back_with_gaps_and_non_finite_values() -> None:
    values = np.array([1e-4, 3e-3, np.nan, 0.2, np.inf, 5e-2, 7e-4])
    present = np.array([True, True, True, True, True, False, True])
    back, measured = unpack_row(pack_row(values, present), len(values))
    assert measured.tolist() == present.tolist()
    finite = present & np.isfinite(values)
    np.testing.assert_allclose(back[finite], values[finite], rtol=math.log(0.2 / 1e-4) / 4091)
    assert math.isnan(back[2]) and back[4] == math.inf and math.isnan(back[5])
    assert unpack_row(None, 3)[1].tolist() == [False] * 3


def test_drift_vs_layer_draws_every_family_per_phase_with_yardstick_and_gate_bound(data: FigureData,
                                                                                  run_dir: Path) -> None:
    fig = drift_vs_layer(data)
    assert isinstance(fig, Figure) and len(fig.axes) == 12, "six families × prefill and decode"
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert list(axes) == [f"{family} · {phase}" for family, _ in FAMILY_ROWS for phase in ("prefill", "decode")]
    assert [fig.axes[2 * r].get_ylabel() for r in range(6)] == [label for _, label in FAMILY_ROWS]
    assert "flash-27k-synthetic" in fig.get_suptitle() and "global mode" in fig.get_suptitle()

    streams = axes["Hidden streams · decode"]
    assert streams.get_yscale() == "log", "stream errors, yardstick and bounds span more than a decade"
    assert axes["Indexer top-k · decode"].get_yscale() == "linear"
    assert axes["Final logits · prefill"].get_yscale() == "log"
    assert line(streams, "yardstick (bf16 noise floor)").get_linestyle() == "--"
    for variant in ("base", "mma-sparse-decode", "triton-indexer", "all"):
        drawn = line(streams, variant)
        expected = page_means(data, variant, "streams.rel_l2", "decode")
        assert drawn.get_xdata().tolist() == list(expected), f"{variant}: one point per layer"
        np.testing.assert_allclose(drawn.get_ydata(), list(expected.values()), err_msg="the page's numbers")

    # the gate's bound, per variant: the tightest mean check at each layer (the patch check binds `all`)
    limits = gate_limits(run_dir, "streams.rel_l2", "all", "decode")
    bound = line(streams, "bound all")
    np.testing.assert_allclose(bound.get_ydata(), [limits[layer] for layer in bound.get_xdata()])
    assert len(bound.get_xdata()) == 43
    # recall bounds come back from the gate's loss (1 − recall), on CSA layers only
    recall = axes["Indexer top-k · decode"]
    limits = gate_limits(run_dir, "indexer.recall", BAD_PATCH, "decode")
    bound = line(recall, f"bound {BAD_PATCH}")
    assert sorted(bound.get_xdata()) == sorted(limits) == [i for i, k in enumerate(data.payload["layers"])
                                                             if k["kind"] == "csa"]
    np.testing.assert_allclose(bound.get_ydata(), [max(1 - limits[layer], 0) for layer in bound.get_xdata()])
    bad = line(recall, BAD_PATCH)
    assert (bad.get_ydata()[bad.get_xdata() >= 10] < bound.get_ydata()[bound.get_xdata() >= 10]).all(), \
        "the failing patch's decode recall is drawn below its bound"

    bars = axes["Final logits · decode"].patches
    heights = [b.get_height() for b in bars]
    assert heights == [data.payload["logits"][v]["decode"]["logits.kl"]["mean"] for v in data.variants]
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend[:5] == ["yardstick (bf16 noise floor)", "base", "mma-sparse-decode", "triton-indexer", "all"]
    assert any(t.startswith("gate bound") for t in legend) and "CSA (compressed, indexer)" in legend


def test_past_six_variants_colours_come_round_with_another_line_style(tmp_path: Path) -> None:
    data = FigureData(payload={"variants": ["yardstick"] + [f"v{i}" for i in range(8)]}, bounds={},
                      variants=["yardstick"] + [f"v{i}" for i in range(8)])
    styles = [variant_style(data, f"v{i}") for i in range(8)]
    assert len({s["color"] for s in styles[:6]}) == 6 and styles[6]["color"] == styles[0]["color"]
    assert len({(s["color"], str(s["linestyle"])) for s in styles}) == 8, "no two variants drawn alike"
    assert len({s["marker"] for s in styles}) == 8


def test_drift_vs_layer_without_a_gate_draws_no_bound(tmp_path: Path) -> None:
    fig = drift_vs_layer(FigureData.load(small_run(tmp_path / "run", attribution=False)))
    assert not [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_label().startswith("bound ")]
    assert not any(t.get_text().startswith("gate bound") for t in fig.legends[0].get_texts())


def test_figures_draw_only_the_chosen_variants(run_dir: Path) -> None:
    data = FigureData.load(run_dir, ["all", "base"])
    assert data.variants == ["yardstick", "all", "base"]
    streams = drift_vs_layer(data).axes[0]
    assert {ln.get_label() for ln in streams.get_lines() if not ln.get_label().startswith("_")} == {
        "yardstick (bf16 noise floor)", "all", "base", "bound all", "bound base"}
    assert "variant all" in heatmap(data).get_suptitle(), "the heatmap shows the first chosen variant"
    with pytest.raises(UsageError, match="'nope' is not in .*its variants: base, mma-sparse-decode"):
        FigureData.load(run_dir, ["nope"])


def test_heatmap_is_layer_by_bin_with_chunk_turn_and_decode_marks(data: FigureData) -> None:
    fig = heatmap(data)
    ax, colourbar = fig.axes
    bins = data.payload["bins"]
    n_bins = len(bins["pos_bin"])
    image = ax.get_images()[0]
    assert image.get_array().shape == (43, n_bins)
    assert colourbar.get_ylabel() == "stream rel L2" and "variant base" in fig.get_suptitle()
    expected = np.vstack([unpack_row(r, n_bins)[0] for r in data.payload["heat"]["streams.rel_l2"]["base"]])
    np.testing.assert_array_equal(image.get_array().filled(np.nan), expected)
    assert ax.get_ylabel() == "layer" and ax.get_xlabel().startswith("token position")

    marks = {"chunk": set(), "decode": set(), "turn": set()}
    for c in range(1, n_bins):
        if bins["phase"][c] != bins["phase"][c - 1]:
            marks["decode"].add(c - 0.5)
        elif bins["phase"][c] == "prefill" and bins["chunk"][c] != bins["chunk"][c - 1]:
            marks["chunk"].add(c - 0.5)
        if bins["turn"][c] != bins["turn"][c - 1]:
            marks["turn"].add(c - 0.5)
    assert [len(marks[k]) for k in ("chunk", "turn", "decode")] == [1, 6, 1], "2 chunks, preamble + 6 turns, decode"
    drawn = {"chunk": set(), "decode": set(), "turn": set()}
    for ln in ax.get_lines():
        x = ln.get_xdata()
        if len(x) == 2 and x[0] == x[1]:
            kind = "turn" if ln.get_linestyle() == "--" else "decode" if ln.get_linewidth() > 2 else "chunk"
            drawn[kind].add(float(x[0]))
    assert drawn == marks

    strip = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert len(strip) == 43, "one kind cell per layer"
    kinds = [layer["kind"] for layer in data.payload["layers"]]
    assert [tuple(p.get_facecolor()[:3]) for p in strip[:4]] == [
        tuple(int(KIND_COLOURS[k][i:i + 2], 16) / 255 for i in (1, 3, 5)) for k in kinds[:4]]


def test_boundary_labels_give_way_to_the_decode_label() -> None:
    """30 columns: chunk 1 starts at column 10, decode at 11 — too close for two labels on one row."""
    bins = {"pos_bin": list(range(30)), "phase": ["prefill"] * 11 + ["decode"] * 19,
            "chunk": [0] * 10 + [1] + [-1] * 19, "turn": [0] * 5 + [1] * 25}
    ax = Figure().subplots()
    handles = _boundary_marks(ax, bins)
    assert [t.get_text() for t in ax.texts] == ["decode", "chunk 0", "turn 0", "turn 1"]
    assert [h.get_label() for h in handles] == ["prefill chunk boundary", "prefill → decode", "turn boundary"]
    assert sorted(ln.get_xdata()[0] for ln in ax.get_lines()) == [4.5, 9.5, 10.5]


def test_heatmap_of_a_recall_draws_its_loss_and_refuses_unknown_metrics(data: FigureData) -> None:
    fig = heatmap(data, "indexer.recall")
    assert fig.axes[1].get_ylabel() == "1 − indexer recall@k"
    grid = fig.axes[0].get_images()[0].get_array()
    recall = np.vstack([unpack_row(r, grid.shape[1])[0] for r in data.payload["heat"]["indexer.recall"]["base"]])
    csa = [i for i, layer in enumerate(data.payload["layers"]) if layer["kind"] == "csa"]
    np.testing.assert_allclose(grid[csa].filled(np.nan), 1 - recall[csa])
    assert grid.mask[0].all() and grid.mask[1].all(), "SWA layers have no indexer: not measured"
    assert not isinstance(fig.axes[0].get_images()[0].norm, LogNorm) or grid.min() > 0
    with pytest.raises(UsageError, match="'streams.nope' is not kept per position.*streams.rel_l2"):
        heatmap(data, "streams.nope")


def test_context_loss_lens_draws_reference_against_variants(data: FigureData, run_dir: Path) -> None:
    fig = context_loss(data)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["Attention mass on earlier turns", "Attention mass on needles (service_account)",
                      "Indexer recall of earlier-turn rows", "Indexer recall of needle rows (service_account)"]
    assert "decode queries" in fig.get_suptitle()
    mass = fig.axes[0]
    reference = line(mass, "reference")
    ref = page_means(data, "yardstick", "ctx.earlier_turn_mass_ref", "decode")
    np.testing.assert_allclose(reference.get_ydata(), list(ref.values()))
    forgot = line(mass, BAD_PATCH).get_ydata()[10:]
    assert (forgot < 0.5 * reference.get_ydata()[10:]).all(), "the bad patch loses the earlier turns"
    assert line(fig.axes[3], f"bound {BAD_PATCH}") is not None
    assert fig.axes[2].get_ylabel() == "earlier-turn indexer recall"
    prefill = context_loss(data, "prefill")
    assert "prefill queries" in prefill.get_suptitle()
    np.testing.assert_allclose(line(prefill.axes[0], "reference").get_ydata(),
                               list(page_means(data, "base", "ctx.earlier_turn_mass_ref", "prefill").values()))


def test_needle_answer_comes_first_when_measured(tmp_path: Path) -> None:
    """The needle answer as the run records it: per needle query, on the final logits row (tap `logits`) and
    through each layer's logit lens (tap `needle.lens`), with the reference's side (`_ref`) on every row."""
    run = small_run(tmp_path / "run", attribution=False)
    store = RunStore(run)
    queries = sorted({(r["step"], r["turn"], r["pos_bin"], r["pos_end"]) for r in
                      pq.read_table(store.part_path(0)).to_pylist() if r["phase"] == "decode"})
    assert len(queries) == 2
    final = {"yardstick": 1.0, "base": 1.0, "mma-sparse-decode": 0.5, "all": 0.0}  # the reference answers both

    def rows(layer: int, tap: str, reference: float, answered: dict[str, float]) -> list[dict]:
        """Every stack's rows for the two queries: it answers the first `rate × 2` of them."""
        out = []
        for variant, rate in answered.items():
            for i, (step, turn, start, end) in enumerate(queries):
                answer = float(i < 2 * rate)
                for metric, value in (("ctx.needle_answer", answer), ("ctx.needle_answer_ref", reference),
                                      ("ctx.needle_margin", 0.5), ("ctx.needle_margin_ref", 2.0),
                                      ("ctx.needle_lost", reference * (1 - answer))):
                    out.append({"variant": variant, "mode": "global", "layer": layer, "phase": "decode",
                                "chunk": -1, "step": step, "turn": turn, "pos_bin": start, "pos_end": end,
                                "tap": tap, "metric": metric, "value": value, "max": value, "count": 1})
        return out

    for layer in range(5):  # tiny: layers 0-4; through the lens the answer appears from layer 3 on
        lensed = {v: rate * (layer >= 3) for v, rate in final.items()}
        added = rows(layer, "needle.lens", float(layer >= 3), lensed)
        store.write_layer(layer, pq.read_table(store.part_path(layer)).to_pylist() + added)
    store.write_layer(5, pq.read_table(store.part_path(5)).to_pylist() + rows(5, "logits", 1.0, final))

    fig = context_loss(FigureData.load(run))
    answer, lens = fig.axes[:2]
    assert answer.get_title() == "Needle answer (final logits)"
    assert [t.get_text() for t in answer.get_yticklabels()] == ["reference"] + list(final)
    assert [b.get_width() for b in answer.patches] == [1.0] + list(final.values())
    texts = [t.get_text() for t in answer.texts]
    assert texts[0] == "1.00 · margin 2" and texts[-1] == "0.00 · margin 0.5 · lost 1.00"
    assert lens.get_title() == "Needle answer through each layer's logit lens"
    assert line(lens, "reference").get_ydata().tolist() == [0, 0, 0, 1, 1]
    assert line(lens, "mma-sparse-decode").get_ydata().tolist() == [0, 0, 0, 0.5, 0.5]
    assert line(lens, "all").get_ydata().tolist() == [0] * 5, "the patched stack never answers"
    assert fig.axes[2].get_title() == "Attention mass on earlier turns"


def test_attribution_matrix_is_patch_by_layer_per_phase(data: FigureData) -> None:
    fig = attribution(data)
    panels = [ax for ax in fig.axes if ax.get_images()]
    assert [ax.get_title(loc="left").split(" · ")[0] for ax in panels] == ["prefill", "decode"]
    assert "indexer mass recall" in fig.get_suptitle(), "the verdict's metric by default"
    assert f"patch {BAD_PATCH}, decode phase, first at layer {BAD_FROM_LAYER}" in fig.get_suptitle()
    patches = [p for p, _, _ in PATCHES]
    decode = panels[1]
    yardstick = data.payload["attribution"]["matrix"]["indexer.mass_recall"]["phases"]["decode"]["_yardstick"]
    assert [t.get_text() for t in decode.get_yticklabels()] == patches + [f"yardstick loss (0–{max(yardstick):.2g})"]
    np.testing.assert_allclose(decode.get_images()[1].get_array()[0], yardstick)
    blame = decode.get_images()[0]
    assert blame.get_array().shape == (6, 43)
    expected = data.payload["attribution"]["matrix"]["indexer.mass_recall"]["phases"]["decode"][BAD_PATCH]
    np.testing.assert_allclose(blame.get_array()[patches.index(BAD_PATCH)], expected)
    assert isinstance(blame.norm, TwoSlopeNorm) and blame.norm.vmin == -blame.norm.vmax, "zero blame is white"
    outlined = [(p.get_x() + 0.5, p.get_y() + 0.5) for p in decode.patches if not p.get_fill()]
    assert outlined == [(BAD_FROM_LAYER, patches.index(BAD_PATCH))], "first divergence of the bad patch"
    assert not [p for p in panels[0].patches if not p.get_fill()], "nothing diverges in prefill"
    assert "attn.tv" in data.payload["attribution"]["matrix"]
    assert "attention TV" in attribution(data, "attn.tv").get_suptitle()
    with pytest.raises(UsageError, match="'moe.flip_rate' is not in attribution.json"):
        attribution(data, "moe.flip_rate")


def test_missing_attribution_is_skipped_with_a_note_and_stale_files_go(tmp_path: Path, capsys) -> None:
    run = small_run(tmp_path / "run", attribution=False)
    with pytest.raises(NothingToDraw, match="no attribution.json"):
        attribution(FigureData.load(run))
    out = tmp_path / "figures"
    out.mkdir()
    (out / "attribution.png").write_bytes(b"from an earlier run")
    written, skipped = write_figures(run, out)
    assert [p.name for p in written] == [f"{v}.{f}" for v in ("drift-vs-layer", "heatmap", "context-loss")
                                         for f in ("png", "svg")]
    assert list(skipped) == ["attribution"] and "dsv4-drift attribute" in skipped["attribution"]
    assert not (out / "attribution.png").exists(), "a stale figure would be listed as this run's"
    assert main(["report", str(run), "--figures"]) == 0
    assert "  attribution: skipped: no attribution.json" in capsys.readouterr().out


def test_written_figures_are_non_blank_pngs_and_byte_stable_svgs(run_dir: Path, tmp_path: Path) -> None:
    written, skipped = write_figures(run_dir, tmp_path / "a")
    assert not skipped and len(written) == 8
    for png in (p for p in written if p.suffix == ".png"):
        height, width = matplotlib.image.imread(png).shape[:2]
        assert width == WIDTH_IN * DPI and height > 400, f"{png.name}: {width}×{height}"
        assert ink(png) > 0.03, f"{png.name} is (nearly) blank: {ink(png):.3f} of its pixels are not white"
    blank = tmp_path / "blank.png"
    Figure(figsize=(WIDTH_IN, 4)).savefig(blank, dpi=DPI, facecolor="white")
    assert ink(blank) == 0, "the blank-canvas check itself must see an empty figure"
    for svg in (p for p in written if p.suffix == ".svg"):
        root = ET.parse(svg).getroot()
        assert root.tag.endswith("svg") and len(root) > 1 and "<dc:date>" not in svg.read_text()
    again, _ = write_figures(run_dir, tmp_path / "b")
    for first, second in zip(written, again):
        assert first.read_bytes() == second.read_bytes(), f"{first.name} differs between two writes of one run"


def test_gate_markdown_links_the_figures_found_in_the_run_directory(run_dir: Path, tmp_path: Path) -> None:
    run = Path(shutil.copytree(run_dir, tmp_path / "run"))
    assert "#### Figures" not in markdown(gate_run(run)), "no figures folder, no section"
    folder = run / FIGURES_DIR
    folder.mkdir()
    for name in ("heatmap.png", "heatmap.svg", "drift-vs-layer.png", "my [zoom].png", "notes.txt"):
        (folder / name).write_bytes(b"")  # the gate lists files by name; it never opens or draws them
    text = markdown(gate_run(run))
    section = text[text.index("#### Figures"):].split("\n\n")
    assert section[1] == f"In `{run}` (links relative to it):"
    assert section[2].splitlines() == [
        "- [drift-vs-layer](figures/drift-vs-layer.png)",
        "- [heatmap](figures/heatmap.png) ([SVG](figures/heatmap.svg))",
        "- [my \\[zoom\\]](figures/my%20%5Bzoom%5D.png)",
    ]


def test_cli_report_writes_the_figures_and_the_gate_summary_lists_them(run_dir: Path, tmp_path: Path,
                                                                       capsys) -> None:
    run = Path(shutil.copytree(run_dir, tmp_path / "run"))
    assert main(["report", str(run), "--figures"]) == 0
    out = capsys.readouterr().out
    for view in VIEWS:
        for fmt in ("png", "svg"):
            path = run / "figures" / f"{view}.{fmt}"
            assert path.is_file() and f"  {path}\n" in out, f"{path} written and listed"
    assert (run / "report.html").is_file(), "the page is still written"
    summary = tmp_path / "summary.md"
    assert main(["gate", str(run), "--quiet", "--summary", str(summary)]) == 1, "triton-indexer fails in decode"
    assert "- [attribution](figures/attribution.png) ([SVG](figures/attribution.svg))" in summary.read_text()

    custom = tmp_path / "slides"
    assert main(["report", str(run), "--figures", str(custom), "--figure-variants", "all, base",
                 "--heatmap-metric", "indexer.recall"]) == 0
    assert sorted(p.name for p in custom.iterdir()) == sorted(f"{v}.{f}" for v in VIEWS for f in ("png", "svg"))
    assert f"figures: {custom}" in capsys.readouterr().out


def test_cli_report_figures_usage_errors(run_dir: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    out = tmp_path / "figures"
    assert main(["report", str(run_dir), "--heatmap-metric", "attn.tv"]) == 2
    assert "only with --figures" in capsys.readouterr().err
    assert main(["report", str(run_dir), "--figures", str(out), "--heatmap-metric", "attn.nope"]) == 2
    assert "'attn.nope' is not kept per position" in capsys.readouterr().err
    assert not out.exists(), "nothing is written when a figure cannot be drawn as asked"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the [figures] extra were not installed
    assert main(["report", str(run_dir), "--figures", str(out)]) == 2
    assert 'pip install -e ".[figures]"' in capsys.readouterr().err
    assert not out.exists()
