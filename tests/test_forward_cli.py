"""`dsv4-drift forward` end to end: golden logits from checkpoints, as a user runs it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from harness.cli.main import main
from hf_oracle import build_hf_model, hf_run, save_hf_checkpoint, tiny_hf_config
from reference.config import TINY
from reference.weights.synth import write_synthetic_checkpoint


def forward(tmp_path, *args: str) -> dict[str, torch.Tensor]:
    out = tmp_path / f"out-{len(list(tmp_path.glob('out-*')))}.safetensors"
    assert main(["forward", *args, "--out", str(out)]) == 0
    return load_file(str(out))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A tiny transformers DeepseekV4 with non-trivial sinks, ape, router biases and tid2eid, saved with
    save_pretrained (sharded), and its own logits for 1,101 prompt tokens + 6 decode steps."""
    model = build_hf_model(tiny_hf_config("flash-like"), seed=0)
    path = save_hf_checkpoint(model, tmp_path_factory.mktemp("hf") / "ckpt", max_shard_size="2MB")
    ids = torch.randint(0, model.config.vocab_size, (1107,), generator=torch.Generator().manual_seed(7)).tolist()
    hf = hf_run(model, ids, chunk_sizes=None, decode_steps=6).logits
    return path, ids, hf


@pytest.mark.parametrize("chunk", [None, 367, 257])
def test_forward_on_a_save_pretrained_checkpoint_reproduces_transformers(tmp_path, hf_checkpoint, chunk):
    """Spec §2 note: an independent fp32 implementation matches transformers to ≤ 2.2e-6 relative L2 on the
    logits; the issue asks ≤ 1e-5 over every prompt and decode position, one-shot and for chunk sizes that
    divide the 1,101-token prompt (367 = 1101/3) and that do not (257)."""
    path, ids, hf = hf_checkpoint
    prompt, decode = tmp_path / "p.json", tmp_path / "d.json"
    prompt.write_text(json.dumps(ids[:1101]))
    decode.write_text(json.dumps(ids[1101:]))
    args = ["--checkpoint", str(path), "--tokens", str(prompt), "--decode-tokens", str(decode)]
    if chunk:
        args += ["--chunk-size", str(chunk)]
    out = forward(tmp_path, *args)
    logits = out["logits"]
    assert logits.shape == (1107, hf.shape[-1]) and logits.dtype == torch.float32
    assert rel(logits, hf) <= 1e-5, f"chunk {chunk}: rel-L2 {rel(logits, hf):.2e}"
    per_position = (logits - hf).norm(dim=-1) / hf.norm(dim=-1)
    # one position's fp32 re-association error is of the whole tensor's order (2.2e-6 measured); 1e-4 leaves 45×
    # room for an unlucky position yet catches any position that is wrong (a lost window or state: O(1))
    assert float(per_position.max()) <= 1e-4, "every position, decode included, must agree"


def test_forward_dump_layers_and_fp64(tmp_path):
    prompt = tmp_path / "p.json"
    prompt.write_text(json.dumps(list(range(1, 200))))
    out = forward(tmp_path, "--model", "tiny", "--tokens", str(prompt), "--dump-layers", "--dtype", "float64")
    assert set(out) == {"logits"} | {f"layers.{L}.out" for L in range(TINY.num_hidden_layers)}
    assert out["layers.0.out"].shape == (199, TINY.hc_mult, TINY.hidden_size)
    assert out["layers.0.out"].dtype == torch.float64 and out["logits"].dtype == torch.float32


def test_official_and_nvfp4_layouts_give_the_logits_of_the_dequantized_hf_layout(tmp_path):
    """Issue: the reference dequantizes the stored FP8/FP4/NVFP4 bits exactly, so the official layout gives the hf
    layout's logits bit for bit. The NVFP4 layout stores the same e2m1 codes and e4m3 block scales with a
    ModelOpt-style global scale (reference.quant.mx32_to_nvfp4), whose product with a block scale is 2^e up to
    2·2^-24 relative: its logits agree within 2^-16 relative L2 (the perturbation, amplified through five layers
    by far less than 2^7), far below any drift the harness measures."""
    prompt = tmp_path / "p.json"
    prompt.write_text(json.dumps(list(range(3, 403))))
    logits = {}
    for fmt in ("hf", "official", "nvfp4"):
        ckpt = write_synthetic_checkpoint(TINY, 3, tmp_path / fmt, fmt=fmt)
        logits[fmt] = forward(tmp_path, "--checkpoint", str(ckpt), "--tokens", str(prompt), "--chunk-size", "128")["logits"]
    assert torch.equal(logits["official"], logits["hf"])
    diff = float((logits["nvfp4"] - logits["hf"]).norm() / logits["hf"].norm())
    assert diff <= 2.0**-16, f"nvfp4 layout logits differ by {diff:.3g} relative L2"


def test_forward_rejects_bad_token_files_with_exit_code_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('[1, 2, "x"]')
    assert main(["forward", "--model", "tiny", "--tokens", str(bad), "--out", str(tmp_path / "o.safetensors")]) == 2
    assert "entry [2]" in capsys.readouterr().err
    big = tmp_path / "big.json"
    big.write_text("[1, 100000]")
    assert main(["forward", "--model", "tiny", "--tokens", str(big), "--out", str(tmp_path / "o.safetensors")]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err
