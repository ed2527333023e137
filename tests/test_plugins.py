"""The plugin API as a user meets it: the README's own example, loading errors, failing ops."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from optimized.engine import OptimizedModel
from optimized.patching import PatchError, PluginOpError, load_plugin, PatchRegistry
from optimized.registry import default_registry
from reference.config import TINY
from reference.weights.synthetic import SyntheticWeights

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_plugin_source() -> str:
    """The complete plugin example from the README (the python block that defines a Patch)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    plugin = [b for b in blocks if "Patch(" in b and "@" in b]
    assert plugin, "README has no plugin example"
    return plugin[0]


@pytest.fixture(scope="module")
def prompt() -> tuple[list[int], list[int]]:
    ids = torch.randint(0, TINY.vocab_size, (1400,), generator=torch.Generator().manual_seed(3)).tolist()
    return ids[:1390], ids[1390:]


class SelectedRows:
    """A probe sink keeping the indexer picks the engine used, per position."""

    def __init__(self) -> None:
        self.picks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def wants(self, tap: str) -> bool:
        return tap == "indexer.selected"

    def sampled(self, positions):
        return torch.zeros_like(positions, dtype=torch.bool)

    def emit(self, tap, positions, **values):
        self.picks.append((positions, values["row_ids"], values["valid"]))


def test_readme_plugin_overrides_indexer_topk_as_documented(tmp_path, prompt):
    plugin = tmp_path / "forget_far.py"
    plugin.write_text(readme_plugin_source())
    registry = default_registry([str(plugin)])
    assert "forget-far" in registry.ids()
    src = SyntheticWeights(TINY, 0)
    base = OptimizedModel(src, []).forward(*prompt, chunk_size=512)
    patched_model = OptimizedModel(src, registry.choose("forget-far"))
    patched = patched_model.forward(*prompt, chunk_size=512)
    n_prompt = len(prompt[0])
    # decode-only patch: prefill logits bit-identical, decode logits changed
    assert torch.equal(patched.logits[:n_prompt], base.logits[:n_prompt])
    assert not torch.equal(patched.logits[n_prompt:], base.logits[n_prompt:])
    # and every row the decode steps kept starts within 1024 tokens of the query
    ids = torch.tensor(prompt[0] + prompt[1])
    layer = next(i for i, k in enumerate(TINY.layer_kinds) if k == "csa")
    block = patched_model.layer(layer)
    sink = SelectedRows()
    x = patched_model.embed(ids)
    patched_model.run_layer(block, x, ids, [512, 512, 366] + [1] * len(prompt[1]), n_prompt, sink)
    decode = [(p, r, v) for p, r, v in sink.picks if int(p[0]) >= n_prompt]
    assert decode
    for positions, rows, valid in decode:
        starts = rows * TINY.compress_ratio(layer)
        assert bool((starts[valid] >= positions[:, None].expand_as(rows)[valid] - 1024).all())
        assert bool(valid.any()), "the recent rows must still be selected"


def test_plugin_that_fails_to_import_names_itself(tmp_path):
    bad = tmp_path / "broken_plugin.py"
    bad.write_text("import not_a_module_anywhere\n")
    with pytest.raises(PatchError, match=r"broken_plugin\.py.*failed to import.*not_a_module_anywhere"):
        load_plugin(PatchRegistry(), str(bad))


def test_plugin_without_patches_is_an_error(tmp_path):
    empty = tmp_path / "empty_plugin.py"
    empty.write_text("x = 1\n")
    with pytest.raises(PatchError, match="defines no module-level Patch"):
        load_plugin(PatchRegistry(), str(empty))


def test_plugin_op_that_raises_names_patch_op_layer_and_phase(tmp_path, prompt):
    plugin = tmp_path / "raising.py"
    plugin.write_text(
        "from optimized.patching import Patch\n"
        "boom = Patch('boom', phases=('prefill',), description='raises')\n"
        "@boom.op('router')\n"
        "def router(ctx, y, token_ids):\n"
        "    raise ValueError('router exploded')\n")
    registry = default_registry([str(plugin)])
    model = OptimizedModel(SyntheticWeights(TINY, 0), registry.choose("boom"))
    with pytest.raises(PluginOpError, match=r"patch 'boom'.*op 'router' at layer 0, prefill.*router exploded"):
        model.forward(prompt[0][:64], [], chunk_size=64)


def test_unknown_op_and_unknown_option_are_rejected():
    from optimized.patching import Patch

    p = Patch("x", phases=("decode",), description="d", defaults={"a": 1})
    with pytest.raises(PatchError, match="unknown op 'no_such_op'"):
        p.op("no_such_op")
    with pytest.raises(PatchError, match=r"unknown option\(s\) \['b'\]"):
        p.resolve_options({"b": 2})


FUSED_W13 = '''
from optimized.patching import Patch
from reference.quant import mx32_to_nvfp4

fused_w13 = Patch("fused-w13-scale", phases=("prefill", "decode"),
                  description="dequantizes w3 with w1's NVFP4 global scale (one scale for a fused gate/up tensor)")


@fused_w13.op("load_weight")
def load(ctx, name, fmt):
    w = ctx.base(name=name, fmt=fmt)
    if fmt == "nvfp4" and name.endswith(".w3.weight"):
        g = lambda n: float(mx32_to_nvfp4(ctx.weights.stored(n)).global_scale)
        w = w * g(name.replace(".w3.", ".w1.")) / g(name)
    return w
'''


def _layer_output(source, choices, layer: int = 3) -> torch.Tensor:
    model = OptimizedModel(source, choices)
    ids = torch.randint(0, TINY.vocab_size, (96,), generator=torch.Generator().manual_seed(5))
    x = model.embed(ids)
    return model.run_layer(model.layer(layer), x, ids, [96], 96)


def test_a_loader_bug_is_one_load_weight_override(tmp_path):
    """The README's fused w1/w3 loader bug, written against `load_weight`: with the calibrated profile the gate/up
    pairs' NVFP4 global scales differ (as in a real checkpoint), so sharing w1's scale changes the experts' output;
    the loader path is the op, not a re-implementation of the experts."""
    plugin = tmp_path / "fused_w13.py"
    plugin.write_text(FUSED_W13)
    registry = default_registry([str(plugin)])
    source = SyntheticWeights(TINY, 0)
    good = _layer_output(source, registry.choose("nvfp4-experts"))
    buggy = _layer_output(source, registry.choose("nvfp4-experts,fused-w13-scale"))
    assert not torch.equal(good, buggy), "sharing w1's global scale for w3 must change the experts' output"
    # on stock FP4 weights (no NVFP4 form is loaded) the override changes nothing
    assert torch.equal(_layer_output(source, []), _layer_output(source, registry.choose("fused-w13-scale")))


LANES = '''
from optimized.patching import Patch

seen = {}
reads_lanes = Patch("reads-lanes", phases=("prefill",), description="records the kernel lanes it is given")
old_style = Patch("old-style", phases=("prefill",), description="a sparse_attention written before the lanes existed")


@reads_lanes.op("sparse_attention")
def attend(ctx, q, window_slots, comp_slots, sink, comp_lanes, comp_length):
    if ctx.kind == "csa":
        seen.setdefault("lanes", []).append((comp_slots, comp_lanes, comp_length))
    return ctx.base(q=q, window_slots=window_slots, comp_slots=comp_slots, sink=sink)


@old_style.op("sparse_attention")
def attend_old(ctx, q, window_slots, comp_slots, sink):
    return ctx.base(q=q, window_slots=window_slots, comp_slots=comp_slots, sink=sink)
'''


def _lanes_seen(tmp_path: Path, prompt, order: str, stem: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(comp_slots, comp_lanes, comp_length) the reads-lanes patch of LANES saw first, with the patches in `order`."""
    plugin = tmp_path / f"{stem}.py"
    plugin.write_text(LANES)
    registry = default_registry([str(plugin)])
    ids = torch.tensor(prompt[0][:200])
    model = OptimizedModel(SyntheticWeights(TINY, 0), registry.choose(order))
    model.run_layer(model.layer(2), model.embed(ids), ids, [200], 200)  # layer 2 is CSA in `tiny`
    module = next(m for name, m in __import__("sys").modules.items() if name.endswith(f"plugin_{stem}"))
    return module.seen["lanes"][0]


def test_sparse_attention_gets_kernel_lanes_and_old_plugins_keep_working(tmp_path, prompt):
    slots, lanes, length = _lanes_seen(tmp_path, prompt, "old-style,reads-lanes", "lanes")
    valid = slots >= 0
    assert torch.equal(length, valid.sum(-1)), "comp_length is topk_length: the number of valid picks"
    for row in range(lanes.shape[0]):  # the valid picks first, in the lanes below comp_length
        n = int(length[row])
        assert sorted(lanes[row, :n].tolist()) == sorted(slots[row][valid[row]].tolist())


def test_a_lanes_reading_patch_below_an_old_style_one_gets_lanes_of_the_slots_it_is_given(tmp_path, prompt):
    """old-style wraps reads-lanes and calls ctx.base without lanes: the lanes are derived from the comp_slots it
    passes (valid rows first, −1 past comp_length) instead of failing for a missing argument."""
    slots, lanes, length = _lanes_seen(tmp_path, prompt, "reads-lanes,old-style", "lanes_below")
    valid = slots >= 0
    assert torch.equal(length, valid.sum(-1))
    for row in range(lanes.shape[0]):
        n = int(length[row])
        assert sorted(lanes[row, :n].tolist()) == sorted(slots[row][valid[row]].tolist())
        assert (lanes[row, n:] == -1).all()


def _scenario_naming_a_plugin(tmp_path: Path) -> Path:
    """tiny-smoke with a variant that names the README's fused-w13 loader bug, a plugin the file does not load."""
    text = (Path(__file__).resolve().parents[1] / "scenarios" / "tiny-smoke.yaml").read_text()
    text = text.replace("    - name: all\n      patches: all",
                        "    - name: fused\n      patches: [nvfp4-experts, fused-w13-scale]")
    assert "fused-w13-scale" in text
    path = tmp_path / "fused.yaml"
    path.write_text(text.replace("# yaml-language-server: $schema=scenario.schema.json\n", ""))
    return path


def test_a_scenario_may_name_patches_from_plugins_given_beside_it(tmp_path):
    """`run FILE --patch-module P` (and the pytest plugin's patch_modules) validates the file's variants against the
    built-ins plus P: a held-back bug written as a plugin can be named in a scenario without editing the file."""
    from harness.scenario import load_scenario

    scenario = _scenario_naming_a_plugin(tmp_path)
    plugin = tmp_path / "fused_w13.py"
    plugin.write_text(FUSED_W13)
    with pytest.raises(Exception, match="unknown patch 'fused-w13-scale'"):
        load_scenario(scenario)
    loaded = load_scenario(scenario, default_registry([str(plugin)]))
    assert loaded.stacks.variant("fused").patches == ("nvfp4-experts", "fused-w13-scale")


def test_a_broken_plugin_beside_a_scenario_names_the_flag(tmp_path, capsys):
    from harness.cli.main import main

    bad = tmp_path / "bad.py"
    bad.write_text("raise ImportError('boom')\n")
    code = main(["run", str(_scenario_naming_a_plugin(tmp_path)), "--patch-module", str(bad),
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "--patch-module: patch module" in err and "boom" in err and "Traceback" not in err


def test_a_run_of_such_a_scenario_can_be_rebuilt_from_its_manifest(tmp_path):
    """--resume and every rank of a sharded run parse the scenario again from the manifest: the --patch-module
    plugins it was started with must be in that registry too."""
    import json

    from harness.cli.main import main
    from harness.run.setup import spec_from_manifest

    plugin = tmp_path / "fused_w13.py"
    plugin.write_text(FUSED_W13)
    out = tmp_path / "run"
    assert main(["run", str(_scenario_naming_a_plugin(tmp_path)), "--patch-module", str(plugin), "--out", str(out),
                 "--no-report", "--no-gate", "--no-local"]) == 0
    spec = spec_from_manifest(json.loads((out / "manifest.json").read_text()))
    assert [c.id for c in spec.variants[-1].choices] == ["nvfp4-experts", "fused-w13-scale"]
