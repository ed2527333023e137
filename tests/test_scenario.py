"""Scenario files: the shipped ones load and resolve, bad ones fail with file:line: field: problem."""

import json
import re
import textwrap
from pathlib import Path

import pytest

from harness.scenario.chat_encoding import PREAMBLE_TURN
from harness.cli.main import main
from harness.errors import UsageError
from harness.scenario import (
    CANONICAL_TAPS,
    SCENARIOS_DIR,
    ScenarioError,
    find_scenario,
    load_scenario,
    parse_scenario,
    resolve_prompt,
    shipped_scenarios,
)
from harness.run.needles import needle_queries
from harness.scenario.prompt import fold_token_id
from harness.scenario.tokenizer import ASSISTANT, SPECIAL_TOKEN_IDS, THINK_START
from optimized.registry import default_registry

BUILT_IN_PATCHES = ["mma-sparse-decode", "triton-indexer", "bf16-indexer-gemm", "bf16-mhc-prelinear", "hash-topk",
                    "nvfp4-experts"]
SHIPPED = sorted(path.stem for path in shipped_scenarios())


@pytest.fixture(scope="module")
def plans():
    """Every shipped scenario with its resolved prompt (prompts only: no model is built)."""
    return {path.stem: (scenario := load_scenario(path), resolve_prompt(scenario)) for path in shipped_scenarios()}


def write(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def issues_of(tmp_path: Path, text: str) -> list[str]:
    path = write(tmp_path, text)
    with pytest.raises(ScenarioError) as caught:
        load_scenario(path)
    return [str(issue) for issue in caught.value.issues]


def assert_issue(issues: list[str], line: int, field: str, *fragments: str) -> None:
    prefix = f"s.yaml:{line}: {field}: "
    matching = [i for i in issues if prefix in i and all(f in i for f in fragments)]
    assert matching, f"expected an issue starting {prefix!r} containing {fragments}; got:\n" + "\n".join(issues)


MINIMAL = """name: t
model: {preset: tiny}
prompt:
  generator: {target_tokens: 2000, turns: 2, needles: 1}
"""


# --------------------------------------------------------------------------- the shipped scenarios


def test_the_shipped_set_is_complete():
    assert set(SHIPPED) >= {"demo-cpu", "flash-10k", "flash-27k", "flash-30k", "messages-example", "tiny-smoke"}
    assert SCENARIOS_DIR == Path(__file__).resolve().parent.parent / "scenarios"
    for path in shipped_scenarios():
        assert path.read_text().startswith("# "), f"{path.name} needs a comment header saying what it is for"


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_scenario_resolves_consistently(plans, name):
    scenario, plan = plans[name]
    assert scenario.name == name
    assert plan.n_prompt > 0 and len(plan.turn_of_position) == plan.n_prompt
    assert all(0 <= token_id < plan.vocab_size for token_id in plan.prompt_ids)
    assert plan.decode_ids is not None and len(plan.decode_ids) == scenario.decode.steps
    assert all(0 <= token_id < plan.vocab_size for token_id in plan.decode_ids)
    assert plan.num_turns >= 2, "every shipped scenario is multi-turn"
    # turn spans tile the prompt, in order, and agree with turn_of_position
    assert plan.turn_spans[0].start == 0 and plan.turn_spans[-1].end == plan.n_prompt
    for before, after in zip(plan.turn_spans, plan.turn_spans[1:]):
        assert before.end == after.start
    for span in plan.turn_spans:
        assert set(plan.turn_of_position[span.start: span.end]) == {span.turn}
    assert plan.turn_of_every_position[plan.n_prompt:] == [plan.turn_spans[-1].turn] * plan.decode_steps
    assert plan.needles, "every shipped scenario plants at least one needle"
    for needle_name, (start, end, turn) in plan.needles.items():
        assert 0 <= start < end <= plan.n_prompt and plan.turn_of_position[start] == turn
        assert plan.needle_texts[needle_name] in plan.token_text(start, end)
    registry = scenario.stacks.registry()
    for variant in scenario.stacks.variants:
        variant.choices(registry)  # what the runner will do must not fail


@pytest.mark.parametrize("name", ["flash-10k", "flash-27k", "flash-30k"])
def test_flash_scenarios_run_base_each_patch_alone_and_all(plans, name):
    scenario, plan = plans[name]
    assert scenario.model.preset == "flash" and scenario.prefill.chunk_size == 8192
    by_name = {v.name: v for v in scenario.stacks.variants}
    assert by_name["base"].patch_ids == ()
    assert by_name["all"].patch_ids == tuple(BUILT_IN_PATCHES)
    for patch_id in BUILT_IN_PATCHES:
        assert by_name[patch_id].patch_ids == (patch_id,)
    target = scenario.prompt.generator.target_tokens
    assert abs(plan.n_prompt - target) <= 0.01 * target, f"target {target}, got {plan.n_prompt}"


def test_flash_27k_has_the_symptoms_shape(plans):
    scenario, plan = plans["flash-27k"]
    assert len(plan.prefill_chunks) == 4 and plan.prefill_chunks[-1][1] == plan.n_prompt
    assert plan.num_turns >= 8
    assert all(loc.turn < plan.num_turns // 2 for loc in plan.needles.values()), plan.needles
    prefill_variant = scenario.stacks.variant("triton-indexer-prefill")
    (choice,) = prefill_variant.choices(scenario.stacks.registry())
    assert choice.options["prefill_rows"] is True and choice.patch.active_phases(choice.options) == ("prefill",
                                                                                                       "decode")


def test_flash_30k_is_the_budget_shape(plans):
    _, plan = plans["flash-30k"]
    assert plan.n_prompt == 30_720 and plan.decode_steps == 64


def test_demo_cpu_shape(plans):
    scenario, plan = plans["demo-cpu"]
    assert scenario.model.preset == "flash-mini"
    assert abs(plan.n_prompt - 8000) <= 45 and len(plan.prefill_chunks) == 3
    assert plan.num_turns == 4 and len(plan.needles) == 3 and plan.decode_steps == 32
    # the 32 teacher-forced steps recall the needles: 5 of them are needle queries the reference answers
    queries = needle_queries(plan.prompt_ids, plan.decode_ids, {k: (v.start, v.end) for k, v in plan.needles.items()})
    assert len(queries) == 5
    assert [v.name for v in scenario.stacks.variants] == ["base", "all"]
    assert scenario.stacks.yardstick and not scenario.measure.local  # the demo's time budget (README)


def test_tiny_smoke_shape(plans):
    scenario, plan = plans["tiny-smoke"]
    assert scenario.model.preset == "tiny" and 500 <= plan.n_prompt <= 700
    assert len(plan.prefill_chunks) == 2 and plan.decode_steps == 4
    assert plan.vocab_folded and plan.vocab_size == 512


def test_messages_continuation_is_the_final_assistant_message(plans):
    scenario, plan = plans["messages-example"]
    final = scenario.prompt.messages[-1]
    assert final.role == "assistant" and final.content not in plan.text
    # the prompt ends with the generation prompt, exactly where the final message's own tokens would follow
    assert plan.tokenizer_prompt_ids[-2:] == [SPECIAL_TOKEN_IDS[ASSISTANT], SPECIAL_TOKEN_IDS[THINK_START]]
    assert plan.decode_text and final.reasoning.startswith(plan.decode_text)
    assert plan.reference_chunk_size is None
    assert scenario.probes.dump.tap_names() == ["indexer.rows", "indexer.scores", "indexer.selected", "attn.probs"]


def test_resolve_prompt_is_deterministic():
    first = resolve_prompt(load_scenario(SCENARIOS_DIR / "demo-cpu.yaml"))
    again = resolve_prompt(load_scenario(SCENARIOS_DIR / "demo-cpu.yaml"))
    assert first.prompt_ids == again.prompt_ids and first.decode_ids == again.decode_ids
    assert first.turn_of_position == again.turn_of_position and first.needles == again.needles
    assert first.text == again.text and first.summary() == again.summary()


@pytest.mark.parametrize("steps", [0, 1, 7, 64])
def test_generator_continuation_has_exactly_decode_steps_tokens(tmp_path, steps):
    plan = resolve_prompt(load_scenario(write(tmp_path, MINIMAL + f"decode: {{steps: {steps}}}\n")))
    assert len(plan.decode_ids) == steps
    if steps >= 7:  # it opens by recalling the needle the last request asks for
        (needle_text,) = plan.needle_texts.values()
        assert needle_text.split()[0] in plan.decode_text


def test_decode_steps_longer_than_the_final_assistant_message_is_an_error(tmp_path):
    path = write(tmp_path, """
        name: t
        model: {preset: tiny}
        prompt:
          messages:
            - {role: user, content: "hi there"}
            - {role: assistant, content: "hello"}
        decode:
          steps: 40
    """)
    with pytest.raises(ScenarioError, match=r"s\.yaml:8: decode\.steps: the final assistant message is \d+ tokens"):
        resolve_prompt(load_scenario(path))


def test_token_file_prompt_with_turns_needles_and_decode_file(tmp_path):
    (tmp_path / "ids").mkdir()
    (tmp_path / "ids" / "prompt.json").write_text(json.dumps(list(range(10, 110))))
    (tmp_path / "ids" / "decode.json").write_text(json.dumps([5, 6, 7, 8, 9]))
    path = write(tmp_path, """
        name: t
        model: {preset: tiny}
        prompt:
          token_file: ids/prompt.json
          decode_token_file: ids/decode.json
          turn_starts: [4, 40, 70]
          needle_spans: {early: [10, 14]}
        decode: {steps: 3}
        probes: {dump: {positions: [0, 102]}}
    """)
    plan = resolve_prompt(load_scenario(path))
    assert plan.prompt_ids == list(range(10, 110)) and plan.decode_ids == [5, 6, 7]
    assert plan.turn_of_position[:4] == [PREAMBLE_TURN] * 4 and plan.turn_of_position[-1] == 2
    assert [(t.turn, t.start, t.end) for t in plan.turn_spans] == [(-1, 0, 4), (0, 4, 40), (1, 40, 70), (2, 70, 100)]
    assert plan.needles["early"] == (10, 14, 0) and not plan.vocab_folded


def test_checkpoint_model_reads_its_config_and_warns_about_a_missing_tokenizer(tmp_path):
    from reference.config import TINY

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    path = write(tmp_path, """
        name: t
        model: {checkpoint: ckpt}
        prompt:
          messages:
            - {role: user, content: "hello"}
        decode: {tokens: greedy, steps: 2}
    """)
    scenario = load_scenario(path)
    assert scenario.model.checkpoint == tmp_path / "ckpt" and scenario.model.config().vocab_size == TINY.vocab_size
    with pytest.warns(UserWarning, match="no tokenizer.json"):
        with pytest.raises(ScenarioError, match="outside the model's vocabulary"):  # a checkpoint is never folded
            resolve_prompt(scenario)
    text = path.read_text()
    assert_issue(issues_of(tmp_path, text.replace("ckpt}", "ckpt, seed: 3}")), 2, "model.seed", "synthetic weights")
    assert_issue(issues_of(tmp_path, text.replace("ckpt}", "nowhere}")), 2, "model.checkpoint", "does not exist")


def test_dump_position_past_the_end_is_reported_when_the_prompt_is_resolved(tmp_path):
    path = write(tmp_path, MINIMAL + "decode: {steps: 2}\nprobes:\n  dump:\n    positions: [3, 99999]\n")
    scenario = load_scenario(path)  # the prompt length is not known yet
    with pytest.raises(ScenarioError, match=r"s\.yaml:8: probes\.dump\.positions\[1\]: position 99999 is past"):
        resolve_prompt(scenario)


def test_generator_target_too_small_names_the_field(tmp_path):
    path = write(tmp_path, MINIMAL.replace("target_tokens: 2000", "target_tokens: 50"))
    with pytest.raises(ScenarioError, match=r"s\.yaml:4: prompt\.generator\.target_tokens: .*too small"):
        resolve_prompt(load_scenario(path))


def test_folding_keeps_special_tokens_distinct_and_inside_the_vocabulary():
    folded = {token: fold_token_id(token_id, 512) for token, token_id in SPECIAL_TOKEN_IDS.items()}
    assert len(set(folded.values())) == len(folded) and all(0 <= i < 512 for i in folded.values())
    assert folded["<｜begin▁of▁sentence｜>"] == 0 and folded["<｜end▁of▁sentence｜>"] == 1
    ordinary = {fold_token_id(i, 512) for i in range(1000, 5000)}
    assert ordinary.isdisjoint(folded.values()) and max(ordinary) < 512
    assert fold_token_id(123_456, 129_280) == 123_456


# --------------------------------------------------------------------------- errors name file, line and field


def test_scenario_errors_are_usage_errors():
    assert issubclass(ScenarioError, UsageError)


def test_unknown_key_suggests_the_right_one(tmp_path):
    issues = issues_of(tmp_path, MINIMAL + "prefill:\n  chunk_sise: 128\n")
    assert_issue(issues, 6, "prefill.chunk_sise", "unknown key", "did you mean 'chunk_size'?")


def test_unknown_top_level_key(tmp_path):
    issues = issues_of(tmp_path, MINIMAL + "decoder: {steps: 4}\n")
    assert_issue(issues, 5, "decoder", "unknown key", "did you mean 'decode'?")


def test_wrong_type(tmp_path):
    issues = issues_of(tmp_path, MINIMAL + "decode:\n  steps: many\n")
    assert_issue(issues, 6, "decode.steps", "expected an integer, got a string ('many')")
    issues = issues_of(tmp_path, MINIMAL + "stacks:\n  yardstick: 1\n")
    assert_issue(issues, 6, "stacks.yardstick", "expected true or false")


def test_bad_enum_value(tmp_path):
    issues = issues_of(tmp_path, MINIMAL + "stacks:\n  reference:\n    dtype: float16\n")
    assert_issue(issues, 7, "stacks.reference.dtype", "expected one of float32, float64", "'float16'")
    issues = issues_of(tmp_path, MINIMAL.replace("preset: tiny", "preset: flash-minni"))
    assert_issue(issues, 2, "model.preset", "did you mean 'flash-mini'?")


def test_unknown_patch_id_names_the_variant(tmp_path):
    issues = issues_of(tmp_path, MINIMAL + """
stacks:
  variants:
    - name: fast
      patches: [hash-topk, triton-indexr]
""")
    assert_issue(issues, 9, "stacks.variants[0].patches[1]", "variant 'fast'", "unknown patch 'triton-indexr'",
                 "did you mean 'triton-indexer'?")


def test_unknown_patch_option_names_the_variant(tmp_path):
    issues = issues_of(tmp_path, MINIMAL + """
stacks:
  variants:
    - name: indexer-prefill
      patches: [triton-indexer]
      options:
        triton-indexer: {prefill_row: true}
""")
    assert_issue(issues, 11, "stacks.variants[0].options.triton-indexer.prefill_row", "variant 'indexer-prefill'",
                 "no option 'prefill_row'", "did you mean 'prefill_rows'?")


def test_option_for_an_unselected_patch_and_non_boolean_flag(tmp_path):
    issues = issues_of(tmp_path, MINIMAL + """
stacks:
  variants:
    - {name: a, patches: [hash-topk], options: {triton-indexer: {impl: auto}}}
    - {name: b, patches: [triton-indexer], options: {triton-indexer: {prefill_rows: "false"}}}
""")
    assert_issue(issues, 8, "stacks.variants[0].options.triton-indexer", "does not select")
    assert_issue(issues, 9, "stacks.variants[1].options.triton-indexer.prefill_rows", "true or false")


def test_two_prompt_sources(tmp_path):
    issues = issues_of(tmp_path, MINIMAL + "  token_file: ids.json\n")
    assert_issue(issues, 5, "prompt", "exactly one prompt source", "token_file and generator")


def test_missing_prompt(tmp_path):
    issues = issues_of(tmp_path, "name: t\nmodel: {preset: tiny}\n")
    assert_issue(issues, 1, "prompt", "required section is missing")


def test_missing_name_and_bad_name(tmp_path):
    assert_issue(issues_of(tmp_path, MINIMAL.replace("name: t\n", "")), 1, "name", "required field is missing")
    assert_issue(issues_of(tmp_path, MINIMAL.replace("name: t", "name: My Scenario")), 1, "name",
                 "not a valid scenario name")


def test_python_object_tag_is_rejected_and_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    text = MINIMAL + f'description: !!python/object/apply:builtins.open ["{marker}", "w"]\n'
    issues = issues_of(tmp_path, text)
    assert_issue(issues, 5, "description", "'!!python/object/apply:builtins.open' is not allowed")
    assert not marker.exists(), "a YAML tag ran code"
    issues = issues_of(tmp_path, MINIMAL + "gate: !custom {policy: default}\n")
    assert_issue(issues, 5, "gate", "'!custom' is not allowed")


@pytest.mark.parametrize("text, line, problem", [
    ("name: t\nmodel: {preset: tiny}\nprompt: &p {generator: *p}\n", 3, "recursive alias"),
    ("a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{n}: &{n} [{', '.join(['*' + p] * 10)}]\n" for p, n in zip("abcdef", "bcdefg")), 1, "too large"),
    ("base: &b {preset: tiny}\nname: t\nmodel: {<<: *b}\n", 3, "merge keys"),
    ("name: t\nyes: 1\n", 2, "keys must be plain strings"),
    ("", 1, "the file is empty"),
])
def test_yaml_beyond_plain_data_is_refused(tmp_path, text, line, problem):
    issues = issues_of(tmp_path, text)
    assert any(f"s.yaml:{line}: " in i and problem in i for i in issues), issues


def test_negative_chunk_size(tmp_path):
    issues = issues_of(tmp_path, MINIMAL + "prefill: {chunk_size: -4096}\n")
    assert_issue(issues, 5, "prefill.chunk_size", "must be positive, got -4096")


def test_duplicate_variant_names(tmp_path):
    issues = issues_of(tmp_path, MINIMAL + """
stacks:
  variants:
    - {name: base, patches: []}
    - {name: base, patches: all}
""")
    assert_issue(issues, 9, "stacks.variants[1].name", "duplicate variant name 'base'", "line 8")


def test_duplicate_yaml_key(tmp_path):
    issues = issues_of(tmp_path, MINIMAL + "decode: {steps: 4}\ndecode: {steps: 8}\n")
    assert_issue(issues, 6, "decode", "duplicate key", "line 5")


def test_every_problem_is_reported_at_once(tmp_path):
    broken = "prefill: {chunk_size: 0}\ndecode: {steps: -1}\nmeasure: {local: yes please}\n"
    issues = issues_of(tmp_path, MINIMAL + broken)
    assert len(issues) == 3 and all(re.match(r".*s\.yaml:\d+: \S+: ", i) for i in issues), issues


TOP_KEYS = "name, description, model, prompt, tokenizer, prefill, decode, stacks, measure, probes, gate"
WRONG_SCENARIOS = {
    # each: a wrong scenario and every line the loader prints for it, in line order (the hand-written reader that
    # the pydantic models replaced printed the same lines)
    "typos": ("""
        name: t
        model: {preset: flash-minni}
        prompt:
          generator: {target_tokens: 2000, turns: 0}
        prefill:
          chunk_sise: 128
        decoder: {steps: 4}
        stacks:
          reference: {dtype: float16}
    """, [
        "s.yaml:2: model.preset: expected one of flash, flash-mini, tiny; got 'flash-minni'; did you mean "
        "'flash-mini'?",
        "s.yaml:4: prompt.generator.turns: must be positive, got 0",
        "s.yaml:6: prefill.chunk_sise: unknown key; did you mean 'chunk_size'? (known: chunk_size, "
        "reference_chunk_size)",
        f"s.yaml:7: decoder: unknown key; did you mean 'decode'? (known: {TOP_KEYS})",
        "s.yaml:9: stacks.reference.dtype: expected one of float32, float64; got 'float16'; did you mean 'float64'?",
    ]),
    "types": ("""
        name: My Scenario
        model: {preset: tiny, seed: -1}
        prompt:
          generator: {target_tokens: 2000, thinking: "yes"}
        decode:
          steps: many
          tokens: gredy
        stacks:
          yardstick: 1
        measure: {local: yes please}
        probes:
          bin_size: 0
          dump: {taps: [attn.zz], positions: [1, 1]}
    """, [
        "s.yaml:1: name: 'My Scenario' is not a valid scenario name (allowed: [a-z0-9-]+)",
        "s.yaml:2: model.seed: must be at least 0, got -1",
        "s.yaml:4: prompt.generator.thinking: expected true or false, got a string ('yes')",
        "s.yaml:6: decode.steps: expected an integer, got a string ('many')",
        "s.yaml:7: decode.tokens: expected one of continuation, greedy; got 'gredy'; did you mean 'greedy'?",
        "s.yaml:9: stacks.yardstick: expected true or false, got an integer (1)",
        "s.yaml:10: measure.local: expected true or false, got a string ('yes please')",
        "s.yaml:12: probes.bin_size: must be positive, got 0",
        "s.yaml:13: probes.dump.positions[1]: 1 is listed twice",
        f"s.yaml:13: probes.dump.taps[0]: 'attn.zz' matches no tap; did you mean 'attn.q'? (taps: "
        f"{', '.join(CANONICAL_TAPS)})",
    ]),
    "patches": ("""
        name: t
        model: {preset: tiny}
        prompt:
          generator: {target_tokens: 2000}
        stacks:
          variants:
            - name: fast
              patches: [hash-topk, triton-indexr]
            - name: indexer-prefill
              patches: [triton-indexer]
              options:
                triton-indexer: {prefill_row: true}
            - {name: b, patches: [triton-indexer], options: {triton-indexer: {prefill_rows: "false"}}}
            - {name: c, patches: [hash-topk], options: {triton-indexer: {impl: auto}}}
    """, [
        f"s.yaml:8: stacks.variants[0].patches[1]: variant 'fast': unknown patch 'triton-indexr'; did you mean "
        f"'triton-indexer'? (known: {', '.join(BUILT_IN_PATCHES)})",
        "s.yaml:12: stacks.variants[1].options.triton-indexer.prefill_row: variant 'indexer-prefill': patch "
        "'triton-indexer' has no option 'prefill_row'; did you mean 'prefill_rows'? (options: dot_precision, impl, "
        "masked_value, prefill_rows)",
        "s.yaml:13: stacks.variants[2].options.triton-indexer.prefill_rows: variant 'b': patch 'triton-indexer': "
        "option prefill_rows='false' is not true or false",
        "s.yaml:14: stacks.variants[3].options.triton-indexer: variant 'c': options for patch 'triton-indexer', "
        "which this variant does not select (selected: hash-topk)",
    ]),
    "two-sources": ("""
        name: t
        model: {preset: tiny}
        prompt:
          generator: {target_tokens: 2000}
          token_file: ids.json
    """, [
        "s.yaml:5: prompt: give exactly one prompt source: messages, token_file, generator; got token_file and "
        "generator",
    ]),
    "token-file": ("""
        name: t
        model: {preset: tiny}
        prompt:
          token_file: ids.json
          turn_starts: [0, 5, 3]
          needle_spans: {a: [3, 1]}
        decode: {tokens: [1, 2, 3], steps: 2}
        prefill: {chunk_size: 2.5, reference_chunk_size: 0}
    """, [
        "s.yaml:5: prompt.turn_starts[2]: turn starts must increase; 3 follows 5",
        "s.yaml:6: prompt.needle_spans.a: expected [start, end) with start < end, got [3, 1]",
        "s.yaml:7: decode.tokens: 3 ids given for 2 decode steps",
        "s.yaml:8: prefill.chunk_size: expected an integer, got a number (2.5)",
        "s.yaml:8: prefill.reference_chunk_size: must be positive, got 0",
    ]),
    "continuation": ("""
        name: t
        model: {preset: tiny}
        prompt:
          messages:
            - {role: user, content: hi}
            - {role: assistant, content: hello}
        decode: {tokens: greedy, steps: 2}
    """, [
        "s.yaml:7: decode.tokens: the final assistant message is the continuation, but decode.tokens is greedy: "
        "remove that message or use tokens: continuation",
    ]),
    "chat": ("""
        name: t
        model: {preset: tiny}
        prompt:
          messages:
            - {role: user, content: hi}
            - {role: system, content: "Be brief."}
            - {role: assistant, content: hello}
    """, ["s.yaml:6: prompt.messages[1]: a system message may only come first"]),
}


@pytest.mark.parametrize("name", WRONG_SCENARIOS)
def test_wrong_scenarios_print_exactly_these_lines(tmp_path, name):
    text, expected = WRONG_SCENARIOS[name]
    (tmp_path / "ids.json").write_text(json.dumps(list(range(8))))
    issues = issues_of(tmp_path, text)
    assert [issue.replace(f"{tmp_path}/", "") for issue in issues] == expected


def test_yaml_syntax_error_names_the_line(tmp_path):
    issues = issues_of(tmp_path, MINIMAL + "decode: {steps: 4\n")
    assert issues and issues[0].startswith(f"{tmp_path / 's.yaml'}:") and "YAML syntax error" in issues[0]


def test_continuation_needs_something_to_continue(tmp_path):
    issues = issues_of(tmp_path, """
        name: t
        model: {preset: tiny}
        prompt:
          messages: [{role: user, content: hi}]
        decode: {steps: 4, tokens: continuation}
    """)
    assert_issue(issues, 5, "decode.tokens", "needs a final assistant message")


def test_chat_structure_errors_point_at_the_message(tmp_path):
    issues = issues_of(tmp_path, """
        name: t
        model: {preset: tiny}
        prompt:
          messages:
            - {role: user, content: "hi", needles: {key: "not in the text"}}
        decode: {tokens: greedy}
    """)
    assert_issue(issues, 5, "prompt.messages[0]", "needle 'key'")


def test_plugin_patches_are_validated_too(tmp_path):
    (tmp_path / "my_patch.py").write_text(textwrap.dedent("""
        from optimized.patching import Patch
        DROP = Patch("drop-far-rows", phases=("decode",), description="test plugin", defaults={"window": 1024})
    """))
    text = MINIMAL + """
stacks:
  patch_modules: [my_patch.py]
  variants:
    - {name: drop, patches: [drop-far-rows], options: {drop-far-rows: {window: 512}}}
    - {name: typo, patches: [drop-far-row]}
"""
    issues = issues_of(tmp_path, text)
    assert_issue(issues, 10, "stacks.variants[1].patches[0]", "did you mean 'drop-far-rows'?")
    scenario = load_scenario(write(tmp_path, text.replace("    - {name: typo, patches: [drop-far-row]}\n", "")))
    (choice,) = scenario.stacks.variant("drop").choices(scenario.stacks.registry())
    assert choice.options == {"window": 512}
    assert scenario.stacks.patch_modules == (str(tmp_path / "my_patch.py"),)


def test_defaults(tmp_path):
    scenario = parse_scenario(textwrap.dedent(MINIMAL))
    assert scenario.prefill.chunk_size == 8192 and scenario.prefill.reference_chunk_size == 8192
    assert scenario.decode.steps == 16 and scenario.decode.tokens == "continuation"
    assert scenario.stacks.reference.dtype == "float32" and scenario.stacks.yardstick
    assert [v.name for v in scenario.stacks.variants] == ["base", "all"]
    assert scenario.stacks.variant("all").patch_ids == tuple(default_registry().built_in_ids())
    assert scenario.measure.local and not scenario.measure.force_decisions
    assert (scenario.probes.bin_size, scenario.probes.attn_sample_every, scenario.probes.logits_sample_every) == (
        512, 64, 256)
    assert scenario.gate.policy == "default" and scenario.tokenizer == "auto"


def test_find_scenario_accepts_shipped_names():
    assert find_scenario("demo-cpu") == SCENARIOS_DIR / "demo-cpu.yaml"
    with pytest.raises(ScenarioError, match="did you mean 'demo-cpu'"):
        find_scenario("demo-cp")


# --------------------------------------------------------------------------- the CLI


def test_validate_exit_codes(tmp_path, capsys):
    assert main(["scenarios", "validate", *map(str, shipped_scenarios())]) == 0
    good = write(tmp_path, MINIMAL, "good.yaml")
    bad = write(tmp_path, MINIMAL + "prefill: {chunk_size: -1}\n", "bad.yaml")
    capsys.readouterr()
    assert main(["scenarios", "validate", str(good), str(bad)]) == 2
    captured = capsys.readouterr()
    assert f"{bad}:5: prefill.chunk_size: must be positive" in captured.err
    assert f"ok: {good}" in captured.out


def test_list_shows_every_shipped_scenario(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["scenarios", "list"]) == 0
    out = capsys.readouterr().out
    for name in SHIPPED:
        assert name in out


def test_render_prints_user_text_verbatim_without_markup(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    hostile = "[bold]not bold[/bold] [/nope] <script>alert(1)</script> [link=http://x]y[/link]"
    path = write(tmp_path, f"""
        name: t
        description: "[red]desc[/red]"
        model: {{preset: tiny}}
        prompt:
          messages:
            - {{role: user, content: '{hostile}', needles: {{tag: "[bold]not bold"}}}}
            - {{role: assistant, content: "[italic]reply[/italic] and more words here"}}
        decode: {{steps: 6}}
    """)
    assert main(["scenarios", "render", str(path), "--ids", "--max-chars", "0"]) == 0
    out = capsys.readouterr().out
    assert hostile in out
    assert "[italic]reply" in out  # the continuation too
    assert "\x1b[" not in out  # not a terminal: no escape codes either


def test_render_elides_long_turns_but_keeps_needles(capsys, monkeypatch, plans):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["scenarios", "render", "demo-cpu", "--max-chars", "300"]) == 0
    out = capsys.readouterr().out
    assert "characters elided" in out
    _, plan = plans["demo-cpu"]
    for text in plan.needle_texts.values():
        assert text in out
