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
