"""The JSON Schemas of scenario and policy files: shipped beside the files, current with the pydantic models, named by
every shipped file's first line (the YAML language server's `$schema` comment), and valid for every shipped file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jsonschema  # a [test] dependency: a missing one must fail, not skip the schema checks
import pytest
import yaml

from harness.cli.main import main
from harness.gate.policy import POLICIES_DIR, Policy, load_policy
from harness.gate.policy import SCHEMA_FILE as POLICY_SCHEMA
from harness.scenario.load import SCHEMA_FILE as SCENARIO_SCHEMA
from harness.scenario.load import load_scenario, shipped_scenarios
from harness.scenario.schema import Scenario
from harness.scenario.validation import schema_json

REGENERATE = ("dsv4-drift scenarios schema > scenarios/scenario.schema.json && "
              "dsv4-drift gate --schema > harness/gate/policies/policy.schema.json")
SHIPPED = [(path, SCENARIO_SCHEMA, load_scenario) for path in shipped_scenarios()] + \
          [(path, POLICY_SCHEMA, load_policy) for path in sorted(POLICIES_DIR.glob("*.yaml"))]
IDS = [f"{path.parent.name}/{path.name}" for path, _, _ in SHIPPED]


def validator(schema_file: Path):
    schema = json.loads(schema_file.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("model, schema_file", [(Scenario, SCENARIO_SCHEMA), (Policy, POLICY_SCHEMA)])
def test_the_shipped_schema_files_are_current(model, schema_file):
    assert schema_file.read_text() == schema_json(model), \
        f"{schema_file} differs from {model.__module__}.{model.__name__}; regenerate with: {REGENERATE}"


@pytest.mark.parametrize("argv, schema_file", [(["scenarios", "schema"], SCENARIO_SCHEMA),
                                               (["gate", "--schema"], POLICY_SCHEMA)])
def test_the_cli_prints_the_schema(capsys, argv, schema_file):
    assert main(argv) == 0
    assert capsys.readouterr().out == schema_file.read_text()


def test_gate_without_a_run_dir_is_a_usage_error(capsys):
    assert main(["gate"]) == 2
    assert "RUN_DIR is required (or --schema" in capsys.readouterr().err


@pytest.mark.parametrize("path, schema_file, load", SHIPPED, ids=IDS)
def test_every_shipped_file_names_its_schema_and_is_valid_under_it(path, schema_file, load):
    first_line = path.read_text().splitlines()[0]
    assert first_line == f"# yaml-language-server: $schema={os.path.relpath(schema_file, path.parent)}"
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in validator(schema_file).iter_errors(yaml.safe_load(path.read_text()))]
    assert not errors, f"{path} under {schema_file.name}:\n" + "\n".join(errors)
    load(path)  # and through the pydantic models, with the checks a JSON Schema cannot state


GOOD_SCENARIO = {"name": "t", "model": {"preset": "tiny"}, "prompt": {"generator": {"target_tokens": 2000}}}


@pytest.mark.parametrize("change", [
    {"prefill": {"chunk_sise": 128}},  # unknown key
    {"decode": {"steps": "many"}},
    {"decode": {"tokens": "gredy"}},
    {"name": "My Scenario"},
    {"model": {"preset": "flash-minni"}},
    {"model": {"preset": "tiny", "checkpoint": "ckpt"}},  # exactly one model source
    {"prompt": {"generator": {"target_tokens": 2000}, "token_file": "ids.json"}},  # exactly one prompt source
    {"prompt": {"messages": [{"role": "usr"}]}},
    {"stacks": {"variants": []}},
    {"probes": {"dump": {"taps": ["Attn"]}}},
])
def test_the_scenario_schema_rejects_what_editors_should_flag(change):
    check = validator(SCENARIO_SCHEMA)
    assert check.is_valid(GOOD_SCENARIO)
    assert not check.is_valid(GOOD_SCENARIO | change), change


GOOD_CHECK = {"name": "a", "metric": "streams.rel_l2", "layers": ["csa", "2-10", 3], "phases": "both",
              "bound": {"yardstick": "2**-4 / 2**-8"}}


@pytest.mark.parametrize("change", [
    {"tolerance": 3},
    {"metric": "streams.rel_l3"},
    {"metric": "ctx.needle_mass_ref"},  # a measurement, not a drift
    {"bound": {"yardstick": 2, "base": 2}},
    {"bound": {"absolute": -1}},
    {"aggregate": "median"},
    {"layers": ["cas"]},
    {"phases": ["prefil"]},
])
def test_the_policy_schema_rejects_what_editors_should_flag(change):
    check = validator(POLICY_SCHEMA)
    assert check.is_valid({"checks": [GOOD_CHECK]})
    assert not check.is_valid({"checks": [GOOD_CHECK | change]}), change
