"""Issue #13 from a user's side: bad inputs and faults give one line naming the file, flag, field, patch/op/layer
or tensor and a documented exit code (README, Exit codes); a run that stops is marked and resumable; nothing
passes silently; `run`, `gate.json` and `report.html` tell one story; threads and housekeeping.

Each test drives the CLI (`harness.cli.main.main`) as a user would and reads what it printed and wrote.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import torch

from harness.cli.main import main
from harness.cli.threads import available_cores, default_threads, oversubscription, narrow_model_threads
from harness.report.html import extract_payload
from harness.report.data import SIGNIFICANT_DIGITS
from harness.run.store import RunStore
from optimized.patching import Patch, PatchError, PatchRegistry, shadowed_patches
from optimized.registry import default_registry
from test_gate import STREAM_POLICY, good_streams, make_run, rows_for, write

TINY_SCENARIO = """\
name: {name}
model: {{preset: tiny, seed: 0}}
prompt:
  token_file: {tokens}
decode: {{steps: 0}}
stacks:
  variants:
    - {{name: base, patches: []}}
"""

NAN_SCORES_PLUGIN = """\
from optimized.patching import Patch

nan_scores = Patch("nan-scores", phases=("prefill", "decode"), description="NaN into the indexer scores at layer 2")


@nan_scores.op("indexer_logits")
def indexer_logits(ctx, q, weights, positions):
    logits = ctx.base(q=q, weights=weights, positions=positions)
    if ctx.layer == 2:
        logits[:, 0] = float("nan")
    return logits
"""

RAISING_PLUGIN = """\
from pathlib import Path
from optimized.patching import Patch

boom = Patch("boom", phases=("prefill", "decode"), description="raises at layer 2 while boom.raise exists")


@boom.op("router")
def router(ctx, y, token_ids):
    if ctx.layer == 2 and Path(__file__).with_name("boom.raise").exists():
        raise ValueError("router exploded")
    return ctx.base(y=y, token_ids=token_ids)
"""

WRAPPING_PLUGIN = """\
from optimized.patching import Patch

my_fault = Patch("my-fault", phases=("prefill", "decode"), description="halves the attention output")


@my_fault.op("sparse_attention")
def sparse_attention(ctx, q, window_slots, comp_slots, sink):
    out, lse = ctx.base(q=q, window_slots=window_slots, comp_slots=comp_slots, sink=sink)
    return out * 0.5, lse
"""


def scenario_with_tokens(tmp_path: Path, ids: list[int], name: str = "tokens") -> Path:
    (tmp_path / f"{name}.json").write_text(json.dumps(ids))
    return write(tmp_path / f"{name}.yaml", TINY_SCENARIO.format(name=name, tokens=f"{name}.json"))


def one_line_error(capsys, command: str) -> str:
    """The stderr of a command that failed: exactly one line `dsv4-drift COMMAND: …` after any notes, no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith(f"dsv4-drift {command}:")]
    assert len(lines) == 1, f"expected one error line, got:\n{err}"
    return lines[0]


# --------------------------------------------------------------------------- run-time failures: exit 2 and 3


def test_prompt_shorter_than_the_csa_ratio_is_refused_before_any_compute(tmp_path, capsys):
    scenario = scenario_with_tokens(tmp_path, [5, 6, 7], "short")
    assert main(["run", str(scenario), "--out", str(tmp_path / "run")]) == 2
    line = one_line_error(capsys, "run")
    assert f"{scenario}:4: prompt.token_file: the prompt is 3 token(s)" in line and "at least 4" in line
    assert not (tmp_path / "run").exists(), "nothing was started"
    assert main(["scenarios", "validate", str(scenario)]) == 2


def test_plugin_op_that_raises_exits_3_marks_the_run_failed_and_resumes_after_the_fix(tmp_path, capsys):
    plugin = write(tmp_path / "boom.py", RAISING_PLUGIN)
    flag = write(tmp_path / "boom.raise", "")
    out = tmp_path / "run"
    argv = ["run", "tiny-smoke", "--no-local", "--no-report", "--no-gate", "--out", str(out)]
    assert main(argv + ["--patches", "boom", "--patch-module", str(plugin)]) == 3
    line = one_line_error(capsys, "run")
    assert line.startswith("dsv4-drift run: plugin fault: patch 'boom'") and "op 'router' at layer 2, prefill" in line
    assert "router exploded" in line and f"dsv4-drift run --resume {out}" in line
    store = RunStore(out)
    manifest = store.read_manifest()
    assert manifest["status"] == "failed"
    assert manifest["failure"]["layer"] == 2 and manifest["failure"]["stack"] == "boom"
    assert "router exploded" in manifest["failure"]["error"] and manifest["failure"]["state_layer"] == 1
    assert store.completed_layers() == [0, 1], "the layers it finished are kept"
    flag.unlink()  # the fix
    assert main(["run", "--resume", str(out), "--no-report", "--no-gate"]) == 0
    assert store.read_manifest()["status"] == "complete" and store.completed_layers() == [0, 1, 2, 3, 4, 5]
    assert [s["start_layer"] for s in store.read_manifest()["segments"]] == [0, 2]


def test_attribute_and_selftest_report_a_plugin_fault_with_exit_3(tmp_path, capsys, monkeypatch):
    plugin = write(tmp_path / "boom.py", RAISING_PLUGIN)
    write(tmp_path / "boom.raise", "")
    assert main(["attribute", "tiny-smoke", "--patches", "boom", "--patch-module", str(plugin), "--no-report",
                 "--out", str(tmp_path / "attr")]) == 3
    assert "op 'router' at layer 2" in one_line_error(capsys, "attribute")
    assert RunStore(tmp_path / "attr").read_manifest()["status"] == "failed"

    import harness.cli.commands.selftest as selftest
    from optimized.patching import PluginOpError

    def raising(*args, **kwargs):
        raise PluginOpError("patch 'fault-x' (selftest) failed in op 'router' at layer 0, prefill segment 0: boom")

    monkeypatch.setattr(selftest, "check_fault", raising)
    assert main(["selftest", "--only", "routing scale"]) == 3
    assert "plugin fault: patch 'fault-x'" in one_line_error(capsys, "selftest")


def test_an_attribution_that_stopped_resumes_to_the_uninterrupted_result(tmp_path, capsys):
    """An hour-long attribution must not be lost to a fault at layer 40: `attribute --resume` continues its pass from
    the saved state, concludes it, and gives what an uninterrupted attribution gives; then deletes the state."""
    plugin = write(tmp_path / "boom.py", RAISING_PLUGIN)
    flag = write(tmp_path / "boom.raise", "")
    args = ["--patches", "boom,mma-sparse-decode", "--patch-module", str(plugin), "--interactions", "never",
            "--threads", "1", "--no-report"]
    out = tmp_path / "attr"
    assert main(["attribute", "tiny-smoke", *args, "--out", str(out)]) == 3
    store = RunStore(out)
    assert store.completed_layers() == [0, 1] and store.state_path.is_file()
    assert main(["attribute", "--resume", str(out), "--no-report"]) == 3, "still faulty: fails again, same place"
    flag.unlink()  # the fix
    capsys.readouterr()
    assert main(["attribute", "--resume", str(out), "--no-report"]) == 0
    assert f"resuming {out} at layer 2" in capsys.readouterr().err
    assert not store.state_path.exists(), "a finished pass keeps no resume state"
    manifest = store.read_manifest()  # three segments: the first pass, the failed resume, the one that finished
    assert [seg["start_layer"] for seg in manifest["segments"]] == [0, 2, 2]
    assert [seg.get("last_layer") for seg in manifest["segments"]] == [1, None, 4]  # tiny: 5 layers
    assert manifest["wall_seconds"] == pytest.approx(sum(seg["seconds"] for seg in manifest["segments"]), abs=0.02)
    fresh = tmp_path / "fresh"
    assert main(["attribute", "tiny-smoke", *args, "--out", str(fresh)]) == 0
    pd.testing.assert_frame_equal(store.read_metrics().to_pandas(), RunStore(fresh).read_metrics().to_pandas())
    assert json.loads((out / "attribution.json").read_text()) == json.loads((fresh / "attribution.json").read_text())
    assert main(["attribute", "--resume", str(out)]) == 2
    assert "the attribution is complete" in one_line_error(capsys, "attribute")
    assert main(["run", "tiny-smoke", "--no-gate", "--no-report", "--out", str(tmp_path / "run")]) == 0
    assert main(["attribute", "--resume", str(tmp_path / "run")]) == 2
    assert "not an attribution's run directory" in one_line_error(capsys, "attribute")
    assert main(["attribute", "tiny-smoke", "--resume", str(out)]) == 2


def _stopped_run_and_attribution(tmp_path, capsys) -> tuple[Path, Path]:
    """A run and an attribution of tiny-smoke stopped by a plugin that raises (exit 3), each resumable."""
    plugin = write(tmp_path / "boom.py", RAISING_PLUGIN)
    write(tmp_path / "boom.raise", "")
    run, attr = tmp_path / "run", tmp_path / "attr"
    common = ["--patches", "boom", "--patch-module", str(plugin), "--no-report", "--threads", "1"]
    assert main(["run", "tiny-smoke", *common, "--no-local", "--no-gate", "--out", str(run)]) == 3
    assert main(["attribute", "tiny-smoke", *common, "--interactions", "never", "--out", str(attr)]) == 3
    capsys.readouterr()
    return run, attr


def test_a_resumed_run_or_attribution_that_would_not_fit_is_refused_with_the_numbers(tmp_path, capsys, monkeypatch):
    """A stopped run may be resumed on another machine: `run --resume` and `attribute --resume` check the memory
    estimate as a new run does, and refuse (exit 2) before computing anything; the run stays resumable."""
    import harness.run.memory as memory

    run, attr = _stopped_run_and_attribution(tmp_path, capsys)
    layers = {d: RunStore(d).completed_layers() for d in (run, attr)}
    monkeypatch.setattr(memory, "available_host_bytes", lambda: 0.1 * 2**30)
    assert main(["run", "--resume", str(run), "--no-report", "--no-gate"]) == 2
    assert "predicted peak host memory" in one_line_error(capsys, "run")
    assert main(["attribute", "--resume", str(attr), "--no-report"]) == 2
    assert "predicted peak host memory" in one_line_error(capsys, "attribute")
    for d in (run, attr):  # nothing was computed: the layers and the resume state are as the failure left them
        assert RunStore(d).completed_layers() == layers[d] and RunStore(d).state_path.is_file()


def test_a_run_whose_weights_generator_changed_since_is_not_resumed(tmp_path, capsys):
    """A manifest names the weights' profile, whose code may change under the same name (`calibrated` did on
    2026-12-05): it also keeps the generator's fingerprint, and `run --resume` and `attribute --resume` refuse (exit
    2) when this code's differs — else the layers left would run on other weights. Nothing is computed."""
    run, attr = _stopped_run_and_attribution(tmp_path, capsys)
    layers = {}
    for d in (run, attr):
        store = RunStore(d)
        model = store.read_manifest()["model"]
        assert len(model["weights"]["generator"]) == 16, model["weights"]
        store.update_manifest(model={**model, "weights": {**model["weights"], "generator": "0123456789abcdef"}})
        layers[d] = store.completed_layers()
    assert main(["run", "--resume", str(run), "--no-report", "--no-gate"]) == 2
    assert "generator changed since the run began" in one_line_error(capsys, "run")
    assert main(["attribute", "--resume", str(attr), "--no-report"]) == 2
    assert "generator changed since the run began" in one_line_error(capsys, "attribute")
    for d in (run, attr):
        assert RunStore(d).completed_layers() == layers[d] and RunStore(d).state_path.is_file()


def test_an_attribution_interrupted_in_its_pair_pass_resumes_there(tmp_path, capsys, monkeypatch):
    """Ctrl-C in the interaction pass's layer 2: --resume skips the complete first pass, continues the pair pass from
    its saved state, and concludes with what an uninterrupted attribution gives."""
    from harness.run.runner import LockstepRunner

    run_layer = LockstepRunner.run_layer
    interrupt = {"armed": True}

    def interrupting(self, layer, streams, weights=None):
        if interrupt["armed"] and self.store.dir.name == "interactions" and layer == 2:
            raise KeyboardInterrupt
        return run_layer(self, layer, streams, weights)

    monkeypatch.setattr(LockstepRunner, "run_layer", interrupting)
    args = ["--patches", "hash-topk,mma-sparse-decode,bf16-mhc-prelinear", "--interactions", "always",
            "--threads", "1", "--no-report"]
    out = tmp_path / "attr"
    assert main(["attribute", "tiny-smoke", *args, "--out", str(out)]) == 130
    pairs = RunStore(out / "interactions")
    assert pairs.read_manifest()["status"] == "interrupted" and pairs.completed_layers() == [0, 1]
    assert RunStore(out).read_manifest()["status"] == "complete" and not RunStore(out).state_path.exists()
    first_pass = RunStore(out).read_metrics().to_pandas()
    interrupt["armed"] = False
    capsys.readouterr()
    assert main(["attribute", "--resume", str(out), "--no-report"]) == 0
    assert f"resuming {out} after its first pass" in capsys.readouterr().err
    pd.testing.assert_frame_equal(RunStore(out).read_metrics().to_pandas(), first_pass)  # not run again
    assert [seg["start_layer"] for seg in pairs.read_manifest()["segments"]] == [0, 2]
    fresh = tmp_path / "fresh"
    assert main(["attribute", "tiny-smoke", *args, "--out", str(fresh)]) == 0
    pd.testing.assert_frame_equal(pairs.read_metrics().to_pandas(),
                                  RunStore(fresh / "interactions").read_metrics().to_pandas())
    assert json.loads((out / "attribution.json").read_text()) == json.loads((fresh / "attribution.json").read_text())


def test_a_damaged_manifest_does_not_hide_the_error_that_stopped_the_run(tmp_path):
    """_record_stop runs inside the runner's `except BaseException`: a UsageError from reading a damaged manifest
    would replace the failure being reported, so it is swallowed like an unwritable run directory."""
    from types import SimpleNamespace

    from harness.run.runner import LockstepRunner

    store = RunStore(tmp_path / "run")
    store.state_path.parent.mkdir(parents=True)
    store.state_path.write_bytes(b"")
    store.manifest_path.write_text("{not json")
    runner = SimpleNamespace(store=store, where={"layer": 1, "stack": "base", "mode": "global"})
    LockstepRunner._record_stop(runner, RuntimeError("the original failure"))  # type: ignore[arg-type]
    assert store.manifest_path.read_text() == "{not json"


def test_patch_option_values_are_checked_against_the_patchs_choices_before_any_compute(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "tiny-smoke", "--patches", "triton-indexer:dot_precision=fp99", "--out", str(out)]) == 2
    line = one_line_error(capsys, "run")
    assert "--patches triton-indexer:dot_precision=fp99: patch 'triton-indexer'" in line
    assert "option dot_precision='fp99' is not one of 'fp32', 'bf16', 'tf32'" in line
    assert not out.exists(), "refused before the run directory was made"
    # the scenario path: the problem points at the option's own line
    scenario = write(tmp_path / "s.yaml", TINY_SCENARIO.format(name="s", tokens="t.json").replace(
        "    - {name: base, patches: []}\n",
        "    - name: idx\n      patches: [triton-indexer]\n      options:\n        triton-indexer: {impl: cuda}\n"))
    (tmp_path / "t.json").write_text(json.dumps(list(range(8))))
    assert main(["scenarios", "validate", str(scenario)]) == 2
    assert f"{scenario}:11: stacks.variants[0].options.triton-indexer.impl: variant 'idx': patch 'triton-indexer': " \
           "option impl='cuda' is not one of 'auto', 'torch', 'triton'" in capsys.readouterr().err


def test_declared_choices_accept_their_types_and_reject_everything_else():
    registry = default_registry()
    indexer = registry.get("triton-indexer")
    assert indexer.resolve_options({"masked_value": 0})["masked_value"] == 0  # 'float' admits integers
    assert indexer.resolve_options({"masked_value": float("-inf")})["masked_value"] == float("-inf")
    with pytest.raises(PatchError, match=r"option prefill_rows=1 is not true or false"):
        indexer.resolve_options({"prefill_rows": 1})  # inferred from the default: a bool, and 1 is not True
    with pytest.raises(PatchError, match=r"option split_k=0 is not an integer from 1 to 4096"):
        registry.get("bf16-mhc-prelinear").resolve_options({"split_k": 0})
    plugin = Patch("k-plugin", ("decode",), "d", defaults={"k": 1}, choices={"k": (1, 2, 4)})
    registry = PatchRegistry()
    registry.add(plugin)
    with pytest.raises(PatchError, match=r"patch 'k-plugin': option k=3 is not one of 1, 2, 4"):
        registry.choose("k-plugin:k=3")
    with pytest.raises(PatchError, match="the default option k=8"):
        Patch("bad-default", ("decode",), "d", defaults={"k": 8}, choices={"k": (1, 2)})


@pytest.mark.parametrize("command", [
    ["run", "tiny-smoke", "--out", "{bad}/run"],
    ["report", "{run}", "--out", "{bad}/r.html"],
    ["forward", "--model", "tiny", "--tokens", "{tokens}", "--out", "{bad}/f.safetensors"],
    ["checkpoint", "synth", "--format", "hf", "--model", "tiny", "--out", "{bad}/ckpt"],
])
@pytest.mark.parametrize("where", ["under a regular file", "read-only"])
def test_an_output_that_cannot_be_written_is_a_usage_error_naming_the_flag(tmp_path, capsys, command, where):
    if where == "under a regular file":
        bad = write(tmp_path / "a-file", "")
    elif os.geteuid() != 0:
        bad = tmp_path / "read-only"
        bad.mkdir()
        bad.chmod(0o555)
    elif Path("/sys").is_dir() and not _writable("/sys"):
        bad = Path("/sys")  # root may write anywhere else; sysfs refuses new entries even to root
    else:
        pytest.skip("no read-only directory for root on this machine")
    run = make_run(tmp_path / "gated", rows_for("streams.rel_l2", good_streams()))
    tokens = write(tmp_path / "t.json", json.dumps(list(range(8))))
    argv = [a.format(bad=bad, run=run, tokens=tokens) for a in command]
    assert main(argv) == 2
    line = one_line_error(capsys, argv[0])
    assert f"--out {bad}/" in line and ("Not a directory" in line or "is a file" in line
                                        or "Permission denied" in line or "Operation not permitted" in line
                                        or "Read-only" in line), line


def _writable(directory: str) -> bool:
    try:
        probe = Path(directory) / ".dsv4-drift-probe"
        probe.mkdir()
        probe.rmdir()
        return True
    except OSError:
        return False


@pytest.mark.parametrize("command", [["run", "tiny-smoke"], ["attribute", "tiny-smoke"],
                                     ["forward", "--model", "tiny", "--tokens", "{tokens}", "--out", "{out}"]])
def test_an_unknown_device_is_a_usage_error(tmp_path, capsys, command):
    tokens = write(tmp_path / "t.json", json.dumps(list(range(8))))
    argv = [a.format(tokens=tokens, out=tmp_path / "o.safetensors") for a in command]
    argv += ["--device", "foo"] + (["--out", str(tmp_path / "run")] if argv[0] != "forward" else [])
    assert main(argv) == 2
    assert "--device 'foo': not a device; expected cpu, cuda or cuda:N" in one_line_error(capsys, argv[0])


def test_report_on_a_truncated_metrics_file_names_the_file(tmp_path, capsys):
    run = make_run(tmp_path / "run", rows_for("streams.rel_l2", good_streams()))
    data = (run / "metrics.parquet").read_bytes()
    (run / "metrics.parquet").write_bytes(data[: len(data) // 2])
    assert main(["report", str(run)]) == 2
    line = one_line_error(capsys, "report")
    assert f"{run / 'metrics.parquet'}: not a readable parquet file, truncated or damaged" in line


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "tiny-hf"
    assert main(["checkpoint", "synth", "--format", "hf", "--model", "tiny", "--out", str(out)]) == 0
    return out


def test_checkpoint_inspect_fails_on_a_truncated_shard_as_run_does(tiny_checkpoint, tmp_path, capsys):
    ckpt = Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))
    assert main(["checkpoint", "inspect", str(ckpt)]) == 0
    shard = sorted(ckpt.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    capsys.readouterr()
    assert main(["checkpoint", "inspect", str(ckpt)]) == 2
    line = one_line_error(capsys, "checkpoint")
    assert f"in {shard.name}" in line and "data ends at byte" in line and "(truncated shard)" in line
    assert main(["checkpoint", "inspect", str(ckpt), "--headers-only"]) == 0, "a header-only download is allowed"
    scenario = write(tmp_path / "s.yaml", f"name: s\nmodel: {{checkpoint: {ckpt}}}\nprompt: {{token_file: t.json}}\n"
                                          "decode: {steps: 0}\n")
    (tmp_path / "t.json").write_text(json.dumps(list(range(8))))
    capsys.readouterr()
    assert main(["run", str(scenario), "--out", str(tmp_path / "run")]) == 2
    assert "(truncated shard)" in one_line_error(capsys, "run")


def test_a_config_with_fewer_layers_than_the_checkpoint_is_refused(tiny_checkpoint, tmp_path, capsys):
    ckpt = Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))
    config = json.loads((ckpt / "config.json").read_text())
    config.update(num_hidden_layers=4, layer_types=config["layer_types"][:4],
                  mlp_layer_types=config["mlp_layer_types"][:4])
    (ckpt / "config.json").write_text(json.dumps(config))
    assert main(["checkpoint", "inspect", str(ckpt)]) == 2
    line = one_line_error(capsys, "checkpoint")
    assert "more belong to layer(s) 4, beyond the config's num_hidden_layers = 4" in line
    scenario = write(tmp_path / "s.yaml", f"name: s\nmodel: {{checkpoint: {ckpt}}}\nprompt: {{token_file: t.json}}\n"
                                          "decode: {steps: 0}\n")
    (tmp_path / "t.json").write_text(json.dumps(list(range(8))))
    assert main(["run", str(scenario), "--out", str(tmp_path / "run")]) == 2
    assert "beyond the config's num_hidden_layers = 4" in one_line_error(capsys, "run")


def test_messages_name_the_field_the_user_wrote_once_and_the_right_kind_of_file(tmp_path, capsys):
    empty = scenario_with_tokens(tmp_path, [], "empty")
    assert main(["run", str(empty), "--out", str(tmp_path / "r1")]) == 2
    line = one_line_error(capsys, "run")
    assert f"{empty}:4: prompt.token_file: token file" in line and "holds no token ids" in line
    assert "turn_starts" not in line
    (tmp_path / "bad.json").write_text("{")
    bad = write(tmp_path / "bad.yaml", TINY_SCENARIO.format(name="bad", tokens="bad.json"))
    assert main(["run", str(bad), "--out", str(tmp_path / "r2")]) == 2
    line = one_line_error(capsys, "run")
    assert line.count("prompt.token_file") == 1 and "not valid JSON" in line
    run = make_run(tmp_path / "run", rows_for("streams.rel_l2", good_streams()))
    tagged = write(tmp_path / "tagged.yaml", "checks:\n  - !!python/object:os.system {}\n")
    assert main(["gate", str(run), "--policy", str(tagged)]) == 2
    err = capsys.readouterr().err
    assert "policy files are plain data" in err and "scenario" not in err
    empty_policy = write(tmp_path / "empty.yaml", "")
    assert main(["gate", str(run), "--policy", str(empty_policy)]) == 2
    err = capsys.readouterr().err
    assert "the policy file is empty" in err and "scenario" not in err
    gate_json = write(tmp_path / "ok.json", "{}")
    assert main(["gate", str(gate_json)]) == 2
    line = one_line_error(capsys, "gate")
    assert f"RUN_DIR {gate_json} is a file, not a run directory" in line and "does not exist" not in line


# --------------------------------------------------------------------------- silent passes


def test_gate_on_a_killed_run_does_not_pass_unless_asked_and_says_so(tmp_path, capsys):
    run = make_run(tmp_path / "run", rows_for("streams.rel_l2", {k: v[:2] for k, v in good_streams().items()}),
                   status="running")
    policy = write(tmp_path / "p.yaml", STREAM_POLICY)
    assert main(["gate", str(run), "--policy", str(policy), "--junit", str(tmp_path / "g.xml")]) == 2
    out = capsys.readouterr().out
    assert "gate: INCOMPLETE" in out and "metrics for layer(s) 0-1 of 0-3" in out
    assert f"dsv4-drift run --resume {run}" in out and "--allow-incomplete" in out
    gate = json.loads((run / "gate.json").read_text())
    assert gate["verdict"] == "incomplete" and gate["exit_code"] == 2 and gate["allow_incomplete"] is False
    assert '<testcase classname="dsv4-drift.run" name="complete"' in (tmp_path / "g.xml").read_text()
    assert main(["gate", str(run), "--policy", str(policy), "--allow-incomplete"]) == 0
    out = capsys.readouterr().out
    assert "note: gated with --allow-incomplete: run" in out and "gate: PASS" in out
    assert json.loads((run / "gate.json").read_text())["allow_incomplete"] is True
    # a failing check still says regression (1), incomplete or not
    bad = good_streams()
    bad["patched"][1] = 0.5
    failing = make_run(tmp_path / "failing", rows_for("streams.rel_l2", {k: v[:2] for k, v in bad.items()}),
                       status="failed")
    assert main(["gate", str(failing), "--policy", str(policy)]) == 1


def test_a_later_patch_that_replaces_an_op_hides_an_earlier_one_and_the_run_says_so(tmp_path, capsys):
    plugin = write(tmp_path / "my_fault.py", WRAPPING_PLUGIN)
    registry = default_registry([str(plugin)])
    hidden = shadowed_patches(registry.choose("my-fault,mma-sparse-decode"))
    assert [(s.op, s.hidden, s.by, s.phases) for s in hidden] == [
        ("sparse_attention", "my-fault", "mma-sparse-decode", ("decode",))]
    assert shadowed_patches(registry.choose("mma-sparse-decode,my-fault")) == [], "listed after, it wraps"
    assert shadowed_patches(registry.choose("all")) == [], "no two built-ins override the same op"
    tokens = write(tmp_path / "t.json", json.dumps(list(range(8))))
    assert main(["forward", "--model", "tiny", "--tokens", str(tokens), "--stack", "optimized", "--patches",
                 "my-fault,mma-sparse-decode", "--patch-module", str(plugin), "--out", str(tmp_path / "o.st")]) == 0
    err = capsys.readouterr().err
    assert ("warning: patch 'mma-sparse-decode' replaces op 'sparse_attention' without calling ctx.base, so "
            "'my-fault' (listed before it) never runs on that op in decode") in err
    assert main(["run", "tiny-smoke", "--no-local", "--no-gate", "--no-report", "--patches", "my-fault,mma-sparse-decode",
                 "--patch-module", str(plugin), "--out", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert ("warning: variant 'my-fault+mma-sparse-decode': patch 'mma-sparse-decode' replaces op 'sparse_attention' "
            "without calling ctx.base, so 'my-fault' (listed before it) never runs on that op in decode") in err


def test_a_replacing_patch_that_acts_at_some_layers_hides_an_earlier_one_there_only():
    """Patch.layers_for: at the other layers the replacer is not in the op chain, so the earlier patch runs there;
    the warning says where it is hidden."""
    from optimized.patching import PatchChoice

    def replacing(pid, layers_for=None):
        patch = Patch(pid, ("decode",), "replaces the top-k", source="test", layers_for=layers_for)
        patch.op("indexer_topk")(lambda ctx, logits, positions, k: (logits.topk(k).indices, logits.topk(k).values > 0))
        return PatchChoice(patch, {})

    from reference.config import get_preset

    cfg = get_preset("tiny")  # 5 layers: SWA, SWA, CSA, HCA, CSA
    csa = lambda cfg, layer, options: cfg.layer_kind(layer) == "csa"  # noqa: E731
    lower = replacing("lower")
    for layers_for, cfg_given, where in (
            (None, None, ""), (None, cfg, ""),  # every layer: nothing to name
            (lambda cfg, layer, options: layer > 0, None, " at the layers where 'upper' acts"),  # no config
            (lambda cfg, layer, options: layer > 0, cfg, " at layers 1-4"),
            (csa, cfg, " at layers 2, 4")):
        (shadowing,) = shadowed_patches([lower, replacing("upper", layers_for)], cfg_given)
        assert (f"so 'lower' (listed before it) never runs on that op in decode{where}; later patches"
                in shadowing.message())
    # hidden only where both act: a lower patch on CSA layers under a replacer on layers 3-4 is hidden at layer 4
    (shadowing,) = shadowed_patches([replacing("lower", csa), replacing("upper", lambda c, layer, o: layer >= 3)], cfg)
    assert shadowing.layers == (4,) and " at layer 4;" in shadowing.message()
    assert shadowed_patches([replacing("lower", csa), replacing("upper", lambda c, layer, o: layer == 3)], cfg) == []


def test_may_call_base_reads_nested_functions_and_same_module_helpers():
    from optimized.patching import may_call_base

    def helper(ctx):
        return ctx.base()

    def via_helper(ctx):
        return helper(ctx)

    def via_closure(ctx):
        def inner():
            return ctx.base()
        return inner()

    def replaces(ctx):
        return ctx.cfg

    assert may_call_base(via_closure) and may_call_base(via_helper) and not may_call_base(replaces)
    assert may_call_base(default_registry().get("bf16-indexer-gemm").ops["linear"])  # other sites: the op beneath
    assert not may_call_base(default_registry().get("mma-sparse-decode").ops["sparse_attention"])
    # hash-topk replaces the router where it acts (hash layers: Patch.layers_for); elsewhere it is not in the chain
    assert not may_call_base(default_registry().get("hash-topk").ops["router"])


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory) -> tuple[Path, int, str]:
    """tiny-smoke with NaN injected into the indexer scores at layer 2, gated (the default) with a report and
    one thread, keeping its resume state."""
    root = tmp_path_factory.mktemp("nan")
    plugin = write(root / "nan_scores.py", NAN_SCORES_PLUGIN)
    out = root / "run"
    rc = main(["run", "tiny-smoke", "--no-local", "--threads", "1", "--keep-state", "--patches", "nan-scores",
               "--patch-module", str(plugin), "--out", str(out)])
    return out, rc, str(plugin)


def test_nan_in_the_indexer_scores_is_a_finding_that_fails_the_run(nan_run):
    out, rc, _ = nan_run
    assert rc == 1, "run gates by default and exits with the gate's code"
    findings = json.loads((out / "findings.json").read_text())
    assert [(f["variant"], f["layer"], f["tap"], f["field"], f["phase"]) for f in findings] == [
        ("nan-scores", 2, "indexer.scores", "scores", "prefill")]
    gate = json.loads((out / "gate.json").read_text())
    assert any("NaN/Inf in nan-scores (global): first at layer 2, tap indexer.scores.scores" in line
               for line in gate["failures"])


# --------------------------------------------------------------------------- one verdict


def test_run_gates_by_default_and_its_report_is_drawn_from_that_verdict(nan_run, tiny_checkpoint):
    out, _, _ = nan_run
    gate = json.loads((out / "gate.json").read_text())
    payload = extract_payload((out / "report.html").read_text())
    assert payload["gate"]["verdict"] == gate["verdict"] == "fail"
    assert payload["gate"]["created"] == gate["created"]
    assert "crossings" not in payload, "no second, yardstick-based story"


def test_the_reports_colours_are_the_gates_units(nan_run):
    """Every coloured cell of the page is a gate unit: ratio > 1 exactly where the gate failed a unit there."""
    out, _, _ = nan_run
    gate = json.loads((out / "gate.json").read_text())
    payload = extract_payload((out / "report.html").read_text())
    failing: dict[tuple, bool] = {}
    for check in gate["checks"]:
        for variant in check["variants"]:
            for u in variant["units"]:
                key = (check["metric"], u["tap"], u["variant"], u["mode"], u["phase"], u["layer"])
                failing[key] = failing.get(key, False) or u["status"] == "fail"
    keys = {k: (v["metric"], v["tap"]) for k, v in payload["metrics"].items()}
    seen = 0
    for key, by_variant in payload["gate"]["cells"].items():
        metric, tap = keys[key]
        for variant, by_mode in by_variant.items():
            for mode, by_phase in by_mode.items():
                for phase, cell in by_phase.items():
                    for layer, ratio in enumerate(cell["ratio"]):
                        if ratio is None:
                            continue
                        units = [f for (m, t, v, md, ph, ly), f in failing.items()
                                 if m == metric and (tap is None or t == tap) and v == variant and md == mode
                                 and ph == phase and ly == layer]
                        assert units, (key, variant, mode, phase, layer)
                        fails = ratio == "__nan__" or ratio == "__inf__" or ratio > 1
                        assert fails == any(units), (key, variant, phase, layer, ratio)
                        seen += 1
    assert seen > 100


BROWSERS = ("chromium", "chromium-browser", "google-chrome")
BROWSER = os.environ.get("CHROMIUM") or next((b for b in map(shutil.which, BROWSERS) if b), None)


SUMMARY_COLUMNS = {"stream rel L2": ("streams.rel_l2", "layer.out"), "attention TV": ("attn.tv", "attn.probs"),
                   "indexer recall": ("indexer.recall", "indexer.selected"),
                   "mass recall": ("indexer.mass_recall", "attn.probs"),
                   "needle recall": ("ctx.needle_recall", "indexer.selected"),
                   "expert flip rate": ("moe.flip_rate", "moe.router"), "logits KL": ("logits.kl", "logits"),
                   "top-1 agree": ("logits.top1_agree", "logits")}
"""The summary's columns (their headers on the page) and the metric and tap each shows."""


def summary_cells(page: Path, tmp: Path) -> list[dict[str, str]]:
    """Every value cell of the drawn summary table (headless Chromium): variant, phase, column header, class,
    data-gated (pass/fail, or None where the gate did not judge it) and text."""
    dom = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp}",
                          "--virtual-time-budget=15000", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=180).stdout
    assert 'data-rendered="ok"' in dom
    table = dom[dom.index('id="summary-table"'):]
    table = table[:table.index("</table>")]
    rows = re.findall(r"<tr>(.*?)</tr>", table)
    headers = re.findall(r"<th[^>]*>([^<]*)</th>", rows[0])[2:]
    cells = []
    for row in rows[1:]:
        variant, phase = re.findall(r'<td class="left">(?:<span[^>]*>)?([^<]*)', row)[:2]
        values = [m for m in re.findall(r'<td class="([^"]*)"(?: data-gated="(\w+)")?[^>]*>([^<]*)</td>', row)
                  if m[0] != "left"]
        cells += [{"variant": variant, "phase": phase, "column": header, "class": cls, "gated": gated or None,
                   "text": text} for header, (cls, gated, text) in zip(headers, values)]
    return cells


@pytest.mark.skipif(BROWSER is None, reason="headless Chromium not installed")
def test_a_stock_engine_the_policy_passes_is_not_painted_red(tmp_path):
    """The issue's case: base at 10× the yardstick is within the default 16× bound; the old page painted it red
    against 2× the yardstick."""
    run = make_run(tmp_path / "run", rows_for("streams.rel_l2", good_streams()))
    policy = write(tmp_path / "p.yaml", STREAM_POLICY)
    assert main(["gate", str(run), "--policy", str(policy), "--quiet"]) == 0
    assert main(["report", str(run)]) == 0
    cells = summary_cells(run / "report.html", tmp_path / "profile")
    base = [c for c in cells if c["variant"] == "base" and c["gated"]]
    assert base and all(c["gated"] == "pass" and "bad" not in c["class"] for c in base), base


@pytest.mark.skipif(BROWSER is None, reason="headless Chromium not installed")
def test_the_drawn_summary_agrees_with_the_gate(nan_run, tmp_path):
    """Each gated summary cell shows the layer the gate holds closest to its limit, the metric there as the gate
    aggregated it (its unit's loss; 1 − loss for recalls and agreement) and is red exactly when that unit failed."""
    out, _, _ = nan_run
    gate = json.loads((out / "gate.json").read_text())
    worst: dict[tuple, tuple[float, int, float, str]] = {}  # (metric, tap, variant, phase) -> ratio, layer, loss
    for check in gate["checks"]:
        for variant in check["variants"]:
            for u in variant["units"]:
                if u["mode"] != "global" or u["value"] in (None, "nan") or u["limit"] in (None, "inf"):
                    continue
                limit = min(x for x in (u["limit"], u["baseline_limit"]) if isinstance(x, (int, float)))
                ratio = u["value"] / limit if limit > 0 else (math.inf if u["value"] > 0 else 0.0)
                key = (check["metric"], u["tap"], u["variant"], u["phase"])
                if key not in worst or ratio > worst[key][0] or (ratio == worst[key][0] and u["layer"] < worst[key][1]):
                    worst[key] = (ratio, u["layer"], u["value"], u["status"])
    cells = [c for c in summary_cells(out / "report.html", tmp_path / "profile") if c["gated"]]
    assert len(cells) >= 8
    n_layers = RunStore(out).read_manifest()["model"]["config"]["num_hidden_layers"]
    for c in cells:
        metric, tap = SUMMARY_COLUMNS[c["column"]]
        ratio, layer, loss, status = worst[(metric, tap, c["variant"], c["phase"])]
        text, where = c["text"].split(" @")
        assert where == ("logits" if layer == n_layers else f"L{layer}"), (c, layer)
        shown = 1 - loss if metric.endswith(("recall", "agree")) else loss
        # the page prints SIGNIFICANT_DIGITS digits: half a unit of the last one, relative
        assert float(text) == pytest.approx(shown, rel=0.5 * 10 ** (1 - SIGNIFICANT_DIGITS), abs=1e-3), (c, shown)
        assert (c["gated"] == "fail") == (ratio > 1) == ("bad" in c["class"]), (c, ratio, status)


def test_gate_redraws_the_report_of_the_run_directory(tmp_path, capsys):
    run = make_run(tmp_path / "run", rows_for("streams.rel_l2", good_streams()))
    policy = write(tmp_path / "p.yaml", STREAM_POLICY)
    assert main(["gate", str(run), "--policy", str(policy), "--quiet"]) == 0
    assert f"report: {run} has no report.html to redraw" in capsys.readouterr().out
    assert main(["report", str(run)]) == 0
    strict = write(tmp_path / "strict.yaml", "checks:\n  - name: tight\n    metric: streams.rel_l2\n"
                                             "    bound: {absolute: 0.001}\n")
    assert main(["gate", str(run), "--policy", str(strict), "--quiet"]) == 1
    assert f"report: {run / 'report.html'} redrawn with this verdict" in capsys.readouterr().out
    assert extract_payload((run / "report.html").read_text())["gate"]["verdict"] == "fail"
    assert main(["gate", str(run), "--policy", str(policy), "--quiet", "--no-report"]) == 0
    assert extract_payload((run / "report.html").read_text())["gate"]["verdict"] == "fail", "--no-report leaves it"


# --------------------------------------------------------------------------- the README's CLI table


def readme_cli_rows() -> dict[str, str]:
    """The README's CLI table: the first cell (the usage) of each row, keyed by its verb (and sub-verb)."""
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    table = text[text.index("## CLI"):text.index("### Exit codes")]
    rows: dict[str, str] = {}
    for usage in re.findall(r"^\| `dsv4-drift ([^`]*)` \|", table, flags=re.M):
        words = usage.split()
        verb = words[0] + (f" {words[1]}" if words[0] == "checkpoint" else "")
        rows[verb] = rows.get(verb, "") + " " + usage
    return rows


def test_the_readme_cli_table_names_every_flag_and_only_real_ones():
    from harness.cli.main import build_parser

    def subparsers(parser):
        return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})

    flags_of: dict[str, set[str]] = {}  # README row (a verb; `checkpoint` verbs have a row each) -> its flags
    for verb, parser in subparsers(build_parser()).items():
        for sub_verb, sub_parser in (subparsers(parser) or {None: parser}).items():
            row = f"{verb} {sub_verb}" if verb == "checkpoint" else verb
            flags_of.setdefault(row, set()).update(f for a in sub_parser._actions for f in a.option_strings)
    rows = readme_cli_rows()
    for verb, flags in flags_of.items():
        flags -= {"-h", "--help"}
        documented = set(re.findall(r"--[a-z][a-z0-9-]*", rows.get(verb, "")))
        assert verb in rows, f"README's CLI table has no row for `dsv4-drift {verb}`"
        assert flags <= documented, f"{verb}: undocumented {sorted(flags - documented)}"
        assert documented <= flags, f"{verb}: the README names flags that do not exist: {sorted(documented - flags)}"


def test_help_and_readme_document_the_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "3 a patch's op raised (plugin fault)" in help_text and "2 usage or input error" in help_text
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert "| 3 | a fault inside a patch" in readme


# --------------------------------------------------------------------------- threads


def test_threads_are_recorded_and_restored(nan_run):
    out, _, _ = nan_run
    manifest = RunStore(out).read_manifest()
    assert manifest["environment"]["torch_threads"] == 1 and manifest["overrides"]["threads"] == 1
    assert manifest["segments"][0]["threads"] == 1


def test_the_default_is_the_available_cores_and_oversubscription_is_said_once(tmp_path, capsys, monkeypatch):
    assert available_cores() == len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert default_threads() == available_cores()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert default_threads() == 1, "a lower OMP_NUM_THREADS is kept"
    monkeypatch.setenv("OMP_NUM_THREADS", "999")
    assert default_threads() == available_cores(), "never more than the cores"
    assert oversubscription(2, 2, 0.1) is None
    assert "oversubscribed: load average 3.0" in oversubscription(2, 2, 3.0)
    assert "--threads 1 is likely faster" in oversubscription(2, 2, 3.0)
    assert "more than the 2 core(s)" in oversubscription(4, 2, 0.0)
    monkeypatch.setattr(os, "getloadavg", lambda: (7.0, 7.0, 7.0))
    tokens = write(tmp_path / "t.json", json.dumps(list(range(8))))
    before = torch.get_num_threads()
    assert main(["forward", "--model", "tiny", "--tokens", str(tokens), "--threads", str(before + 1),
                 "--out", str(tmp_path / "o.st")]) == 0
    assert torch.get_num_threads() == before, "a command restores the caller's thread count"
    from safetensors import safe_open

    with safe_open(str(tmp_path / "o.st"), "pt") as f:
        assert json.loads(f.metadata()["environment"])["torch_threads"] == before + 1
    err = capsys.readouterr().err
    assert err.count("oversubscribed: load average 7.0") + err.count("is more than the") == 1


def test_attribute_says_oversubscription_for_the_threads_it_runs_with(tmp_path, capsys, monkeypatch):
    """A narrow model drops to one thread inside attribute(); the oversubscription note must be for that one thread,
    not for the cores asked for before the scenario was read ("--threads 1 is likely faster" of a 1-thread run)."""
    import harness.cli.threads as threads

    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.7, 1.7, 1.7))
    assert main(["attribute", "tiny-smoke", "--patches", "hash-topk", "--interactions", "never",
                 "--out", str(tmp_path / "attr"), "--no-report"]) in (0, 1)
    err = capsys.readouterr().err
    assert "this run adds 1 thread(s)" in err and err.count("oversubscribed") == 1, err
    # not a terminal: a line per layer instead of the live bar (tiny has 5 layers)
    lines = [line for line in err.splitlines() if " done in " in line]
    assert [line.split(" done in")[0] for line in lines] == [f"layer {k}/5" for k in range(1, 6)], err
    assert all(" left)" in line for line in lines[:-1]) and lines[-1].endswith("elapsed)"), lines  # the time left


def test_the_layer_log_estimates_the_time_left_by_layer_kind(monkeypatch):
    """At Flash width a CSA layer of an attribution took 38–42 s on an H100 and an HCA layer 28–32 s, the first CSA
    layer 62 s with the Triton compiles (README, Benchmarks): the time left is the median of each remaining layer's
    kind (all finished layers' for a kind not seen yet), so the compile does not weigh on every CSA layer."""
    from harness.run.layer_log import LayerLog, format_duration

    clock = iter(range(0, 10_000, 10))
    monkeypatch.setattr("harness.run.layer_log.time.perf_counter", lambda: float(next(clock)))
    kinds = ("swa", "swa", "csa", "hca", "csa", "hca", "csa", "hca")
    log = LayerLog(", 2 ranks")
    times = [45.0, 36.0, 62.0, 40.0, 41.0, 31.0]
    lines = [log.line({"layer": i, "layers": len(kinds), "seconds": s, "kinds": kinds}) for i, s in enumerate(times)]
    # after layer 0: every later layer costs the one finished layer's 45 s (no CSA or HCA layer seen yet)
    assert lines[0] == "layer 1/8 done in 45.0 s (10 s elapsed, 2 ranks; ≈ 5.2 min left)"
    assert log.seconds_left(kinds[6:]) == 51.5 + 35.5  # CSA: median of 62 and 41; HCA: of 40 and 31
    assert lines[-1].endswith("; ≈ 87 s left)")
    assert log.line({"layer": 7, "layers": 8, "seconds": 30.0, "kinds": kinds}).endswith("2 ranks)")  # the last
    log.new_pass()
    assert log.seconds_left(kinds) == 0.0  # a new pass: nothing measured yet
    assert LayerLog().line({"layer": 0, "layers": 3, "seconds": 1.0}).endswith("elapsed)")  # no kinds: no estimate
    assert [format_duration(s) for s in (75, 754, 5400)] == ["75 s", "12.6 min", "1.5 h"]


# --------------------------------------------------------------------------- housekeeping


def test_a_finished_run_deletes_its_resume_state_unless_asked_to_keep_it(nan_run, tmp_path):
    out, _, _ = nan_run
    assert (out / "state" / "streams.pt").is_file(), "--keep-state"
    scenario = scenario_with_tokens(tmp_path, list(range(16)), "sixteen")
    assert main(["run", str(scenario), "--no-gate", "--no-report", "--out", str(tmp_path / "run")]) == 0
    assert not (tmp_path / "run" / "state").exists()
    assert main(["run", "--resume", str(tmp_path / "run")]) == 2, "a complete run has nothing to resume"


def test_scenarios_list_is_not_cut_when_piped(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["scenarios", "list"]) == 0
    out = capsys.readouterr().out
    from harness.scenario import load_scenario, shipped_scenarios

    for path in shipped_scenarios():
        scenario = load_scenario(path)
        assert scenario.description in out and scenario.model.preset in out, scenario.name


def test_token_spans_print_half_open_everywhere(capsys):
    assert main(["scenarios", "validate", "tiny-smoke"]) == 0
    assert "needles: service_account [79, 85) (turn 0)" in capsys.readouterr().out
    assert main(["scenarios", "render", "tiny-smoke"]) == 0
    out = capsys.readouterr().out
    assert "[79, 85)" in out and "positions [0, 46)" in out and "–84" not in out


def test_a_narrow_model_defaults_to_one_thread_unless_threads_are_asked_for():
    """hidden 64 computes in ops too small for a second thread (README: Threads); an explicit --threads, a GPU run
    and a wide model keep their count."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert narrow_model_threads(2, 64, "cpu") is None and torch.get_num_threads() == 2, "asked for: kept"
        assert narrow_model_threads(None, 64, "cuda") is None and torch.get_num_threads() == 2
        assert narrow_model_threads(None, 4096, "cpu") is None and torch.get_num_threads() == 2
        note = narrow_model_threads(None, 64, "cpu")
        assert torch.get_num_threads() == 1 and "hidden size 64" in note and "--threads N" in note
    finally:
        torch.set_num_threads(before)


def test_a_narrow_cpu_run_shards_over_the_cores_only_when_nothing_was_asked_and_it_is_long(monkeypatch):
    import harness.cli.threads as threads

    monkeypatch.setattr(threads, "default_threads", lambda: 2)
    long = threads.SHARD_MIN_TOKEN_LAYERS
    world, note = threads.narrow_model_processes(None, None, 64, "cpu", long, 3)
    assert world == 2 and "2 processes of 1 thread" in note, "the demo's case: two cores, three stacks"
    assert threads.narrow_model_processes(None, None, 64, "cpu", long, 1) == (1, None), "one stack: nothing to deal"
    assert threads.narrow_model_processes(None, None, 64, "cpu", long - 1, 3) == (1, None), "short: start-up bound"
    assert threads.narrow_model_processes(None, None, 4096, "cpu", long, 3) == (1, None), "wide: threads pay"
    assert threads.narrow_model_processes(None, None, 64, "cuda", long, 3) == (1, None)
    assert threads.narrow_model_processes(3, None, 64, "cpu", long, 3) == (3, None), "--devices is kept"
    assert threads.narrow_model_processes(None, 1, 64, "cpu", long, 3) == (1, None), "--threads keeps one process"
    monkeypatch.setattr(threads, "default_threads", lambda: 1)
    assert threads.narrow_model_processes(None, None, 64, "cpu", long, 3) == (1, None), "one core (or OMP_NUM_THREADS=1)"
    monkeypatch.setattr(threads, "default_threads", lambda: 8)
    assert threads.narrow_model_processes(None, None, 64, "cpu", long, 3)[0] == 3, "no more ranks than stacks"


def test_oversubscription_counts_every_process_of_a_sharded_run():
    assert oversubscription(1, 2, 0.9, processes=2) is None, "a job that just ended: its load is still decaying"
    note = oversubscription(1, 2, 1.5, processes=2)
    assert "adds 2 thread(s)" in note and "expect it to run slower" in note, "one process would be slower still"
    assert "--threads 1 is likely faster" in oversubscription(2, 4, 1.5, processes=2)
    assert "2 processes × 2 thread(s) is more than the 2 core(s)" in oversubscription(2, 2, 0.0, processes=2)


@pytest.mark.parametrize("last_line, plugin, user", [
    ("harness.errors.UsageError: tokens.json: not a list", False, True),
    ("OSError: [Errno 28] No space left on device: '/full/disk'", False, True),
    ("PermissionError: [Errno 13] Permission denied", False, True),
    ("optimized.patching.PluginOpError: patch 'x' failed in op 'experts'", True, False),
    ("RuntimeError: reference failed at layer 2", False, False),
    ("KeyError: 3", False, False),
])
def test_a_rank_failure_is_classified_by_the_error_it_raised(last_line, plugin, user):
    """harness.cli.main exits 3 for a patch's fault, 2 for an input or file error and 4 for anything else, on a rank
    as in one process: RankFailed reads the type from the last line of the rank's report."""
    from harness.run.distributed import RankFailed

    e = RankFailed(1, f"rank 1 of 2 failed: {last_line}")
    assert (e.plugin_fault, e.input_fault) == (plugin, user)
    died = RankFailed(1, "rank 1 of 2 died (exit code -9, signal SIGKILL)")
    assert not died.plugin_fault and not died.input_fault
