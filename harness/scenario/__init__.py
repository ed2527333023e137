"""What to run: a scenario file, validated, and its prompt resolved to tokens, turns and needles (DESIGN §7).

    from harness.scenario import load_scenario, resolve_prompt
    scenario = load_scenario("scenarios/demo-cpu.yaml")   # ScenarioError: file:line: field: problem
    plan = resolve_prompt(scenario)                        # token ids, decode ids, turn and needle spans

Modules: `schema` (the scenario tree as pydantic models, its constants), `load` (YAML → Scenario, shipped
scenarios), `yaml_source` (YAML with line numbers, plain data only), `validation` (pydantic errors as
`file:line: field: problem`, shared with the gate policy), `prompt` (Scenario → PromptPlan), `agent_session`
(the synthetic coding-agent generator), `chat_encoding` (DeepSeek-V4's chat format), `tokenizer`,
`token_files`, `weights` (a model spec → a weight source).
"""

from harness.scenario.load import SCENARIOS_DIR, find_scenario, load_scenario, parse_scenario, shipped_scenarios
from harness.scenario.prompt import NeedleLocation, PromptPlan, resolve_prompt
from harness.scenario.schema import CANONICAL_TAPS, Scenario
from harness.scenario.yaml_source import Issue, ScenarioError

__all__ = ["CANONICAL_TAPS", "Issue", "NeedleLocation", "PromptPlan", "SCENARIOS_DIR", "Scenario", "ScenarioError",
           "find_scenario", "load_scenario", "parse_scenario", "resolve_prompt", "shipped_scenarios"]
