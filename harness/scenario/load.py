"""Reading a scenario YAML file into a `harness.scenario.schema.Scenario`, every problem reported as
`file:line: field.path: problem` (all of them at once, in a `ScenarioError`); and finding shipped scenarios."""

from __future__ import annotations

from pathlib import Path

from optimized.patching import PatchRegistry

from harness.scenario.schema import Scenario
from harness.scenario.validation import suggest, validate_located
from harness.scenario.yaml_source import Issue, Located, ScenarioError, load_located, read_located

SCENARIOS_DIR = Path(__file__).resolve().parents[2] / "scenarios"
"""The scenarios shipped with the harness (the repository's top-level `scenarios/`)."""
SCHEMA_FILE = SCENARIOS_DIR / "scenario.schema.json"
"""The scenario JSON Schema the shipped scenarios name in their `# yaml-language-server: $schema=…` line."""


def parse_scenario(text: str, file: str = "<string>", base_dir: str | Path | None = None,
                   plugins: PatchRegistry | None = None) -> Scenario:
    """A Scenario from YAML text; relative paths resolve against `base_dir` (default: the current directory);
    `plugins` as for load_scenario."""
    return _validate(load_located(text, file), file, Path(base_dir) if base_dir is not None else Path.cwd(), plugins)


def load_scenario(path: str | Path, plugins: PatchRegistry | None = None) -> Scenario:
    """Read and validate a scenario file; raises ScenarioError listing every problem as file:line: field: problem.
    `plugins` is a registry holding plugins given beside the file (`--patch-module`): its variants may name their
    patches. The scenario's own `stacks.patch_modules` are loaded into it."""
    p = Path(path)
    return _validate(read_located(p), str(p), p.resolve().parent, plugins)


def _validate(located: Located, file: str, base_dir: Path, plugins: PatchRegistry | None = None) -> Scenario:
    context: dict = {"base_dir": base_dir}
    if plugins is not None:
        context["registry"] = plugins
    return validate_located(Scenario, located, file, context=context)


def shipped_scenarios() -> list[Path]:
    """The scenario files in the repository's `scenarios/` directory, by name."""
    return sorted(SCENARIOS_DIR.glob("*.yaml"))


def find_scenario(name_or_path: str | Path) -> Path:
    """A scenario argument: an existing file path, or the name of a shipped scenario (`demo-cpu`)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    shipped = SCENARIOS_DIR / f"{name_or_path}.yaml"
    if shipped.is_file():
        return shipped
    names = [s.stem for s in shipped_scenarios()]
    raise ScenarioError([Issue(str(p), 1, "", f"no such scenario file, nor a shipped scenario name"
                                               f"{suggest(str(name_or_path), names)} (shipped: {', '.join(names)})")])
