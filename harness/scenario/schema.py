"""Scenarios: what to run, as a validated YAML file (DESIGN §7).

A scenario names the model, the prompt, the stacks and patches, the probes and the gate policy. It
is loaded with `harness.scenario.load.load_scenario(path)`; every problem is reported as `file:line: field.path: problem`
(all of them at once, in a `ScenarioError`, which the CLI turns into exit code 2). YAML is read as
plain data only (see `harness.scenario.yaml_source`): a tag like `!!python/object` is an error, never code.
Relative paths are resolved against the scenario file's directory. `resolve_prompt(scenario)`
turns the prompt section into token ids, turn spans and needle spans (`harness.scenario.prompt`).

Schema (defaults in brackets; every section but name/model/prompt may be left out):

    name: demo-cpu                 required; [a-z0-9-]+, used for run directories
    description: "…"               [""] one line shown by `scenarios list`

    model:                         required; exactly one of preset / checkpoint
      preset: flash-mini           synthetic weights for a preset of reference.config.PRESETS
      seed: 0                      [0] synthetic weight seed (presets only)
      checkpoint: /dir             a checkpoint directory (config.json + safetensors)

    prompt:                        required; exactly one of messages / token_file / generator
      messages:                    explicit chat, rendered with DeepSeek-V4's encoding (spec §9)
        - role: user               system | user | assistant | tool (system only first)
          content: "…"             [""]
          reasoning: "…"           [none] assistant only: the <think> text
          interrupted: false       [false] assistant only: generation was cut off
          tool_calls:              [[]] assistant only
            - {name: read_file, arguments: {path: a.py}}
          tools: [{…JSON schema…}] [[]] system only: tool definitions
          needles: {name: "substring of this message's rendered text"}   [{}]
        A final assistant message is the decode continuation (decode.tokens: continuation), not prompt.
      thinking: true               [true] messages only: thinking mode (spec §9)
      keep_earlier_reasoning: false  [false] messages only: keep reasoning of earlier turns
      token_file: ids.json         a JSON list of prompt token ids
      decode_token_file: d.json    token_file only: the decode ids for decode.tokens: continuation
      turn_starts: [0, 812]        [[]] token_file only: first position of each turn (before: preamble, turn -1);
                                   empty means the whole prompt is turn 0
      needle_spans: {key: [start, end]}  [{}] token_file only: needle token ranges [start, end)
      generator:                   a synthetic coding-agent session (harness.scenario.agent_session)
        kind: agent-session        [agent-session] the only kind
        seed: 1                    [0]
        target_tokens: 9000        required; the prompt lands within 0.5% of it
        turns: 4                   [4] user requests
        needles: 3                 [3] facts planted in the first half of the turns, asked about in the last
        thinking: true             [true]

    tokenizer: auto                [auto] auto (the checkpoint's tokenizer.json if present, else the
                                   deterministic fallback) | fallback | a directory holding tokenizer.json

    prefill:
      chunk_size: 8192             [8192] optimized stacks prefill in chunks of this many tokens
      reference_chunk_size: 8192   [= chunk_size] the reference's chunks; null = the whole prompt at once
                                   (the reference's results do not depend on chunking, DESIGN §3)

    decode:
      steps: 16                    [16, or the length of an id list] teacher-forced decode steps; 0 = prefill only
      tokens: continuation         [continuation] continuation: the text that comes next (the generator's
                                   continuation, a final assistant message, or decode_token_file) | greedy:
                                   the reference's argmax, computed by the runner | [id, id, …] (model ids,
                                   exactly `steps` of them)

    stacks:
      reference:
        dtype: float32             [float32] float32 | float64
        parity: []                 [[]] official QAT steps (spec §7), subset of fp8-kv, indexer-fp4
      yardstick: true              [true] also run the naive-bf16 noise-floor stack
      engine:
        indexer_fp4: false         [false] the stock engine stores indexer keys as FP4 (optimized-stack)
      variants:                    [base (no patches) and all] ≥ 1, names unique, [a-z0-9+._-]+
        - name: base
          patches: []              [] / none / all (every built-in patch) / a list of patch ids
          options: {triton-indexer: {prefill_rows: true}}   [{}] per selected patch
      patch_modules: []            [[]] plugin .py files (relative to this file) or importable modules

    measure:
      local: true                  [true] also run each variant's layer on the reference's layer input
      force_decisions: false       [false] also run with the reference's top-k and expert choices forced in

    probes:
      bin_size: 512                [512] position-bin width of the metrics (tokens)
      attn_sample_every: 64        [64] attention-row metrics on every n-th query position (and all decode steps)
      logits_sample_every: 256     [256] logits metrics on every n-th prompt position (and all decode steps)
      dump:
        positions: []              [[]] absolute positions whose raw tap tensors are saved
        taps: []                   [[]] tap names or glob patterns (attn.*), see CANONICAL_TAPS

    gate:
      policy: default              [default] the built-in policy, or a policy YAML file path

Patch ids and options are checked against `optimized.registry.default_registry(patch_modules)` at
load time, so a typo fails before any model is built, naming the variant.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from harness.scenario.chat_encoding import Message
from harness.scenario.yaml_source import Issue, ScenarioError

NAME_PATTERN = re.compile(r"[a-z0-9-]+")
VARIANT_NAME_PATTERN = re.compile(r"[a-z0-9+._-]+")
TAP_PATTERN = re.compile(r"[a-z0-9_.*?\[\]-]+")
DTYPES = ("float32", "float64")
PARITY_SWITCHES = ("fp8-kv", "indexer-fp4")
TOKENIZER_KEYWORDS = ("auto", "fallback")
DECODE_KEYWORDS = ("continuation", "greedy")
GENERATOR_KINDS = ("agent-session",)
PROMPT_SOURCES = ("messages", "token_file", "generator")
DEFAULT_CHUNK_SIZE = 8192  # optimized-stack §7: the deployed --chunked-prefill-size
CANONICAL_TAPS = (
    # reference/probes.py lists these; every stack emits them. `logits` is the final-norm head output.
    "layer.in", "attn.hc", "ffn.hc", "attn.q", "attn.kv", "compressor.rows", "indexer.rows", "indexer.scores",
    "indexer.selected", "attn.probs", "attn.lse", "attn.out", "moe.router", "moe.out", "layer.out", "logits",
)


# --------------------------------------------------------------------------- the scenario tree


@dataclass(frozen=True)
class ModelSpec:
    preset: str | None = None
    seed: int = 0
    checkpoint: Path | None = None

    @property
    def label(self) -> str:
        return f"{self.preset} (seed {self.seed})" if self.preset else str(self.checkpoint)

    def config(self):
        """The model's `reference.config.ModelConfig` (a checkpoint's config.json is read, no weights)."""
        from reference.config import get_preset, load_config_json

        return get_preset(self.preset) if self.preset else load_config_json(self.checkpoint / "config.json")

    def open_weights(self):
        """The weight source (`harness.scenario.weights.open_weights`): synthetic for a preset, else the checkpoint."""
        from harness.scenario.weights import open_weights

        return open_weights(self.preset, self.seed, self.checkpoint)


@dataclass(frozen=True)
class GeneratorSpec:
    kind: str = "agent-session"
    seed: int = 0
    target_tokens: int = 0
    turns: int = 4
    needles: int = 3
    thinking: bool = True


@dataclass(frozen=True)
class PromptSpec:
    """Exactly one source: `messages`, `token_file` or `generator` (named by `source`)."""

    source: str
    messages: tuple[Message, ...] = ()
    thinking: bool = True
    keep_earlier_reasoning: bool = False
    token_file: Path | None = None
    decode_token_file: Path | None = None
    turn_starts: tuple[int, ...] = ()
    needle_spans: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    generator: GeneratorSpec | None = None

    @property
    def prompt_messages(self) -> tuple[Message, ...]:
        """The messages that form the prompt: all but a final assistant message (that one is the continuation)."""
        if self.messages and self.messages[-1].role == "assistant":
            return self.messages[:-1]
        return self.messages

    @property
    def continuation_message(self) -> Message | None:
        return self.messages[-1] if self.messages and self.messages[-1].role == "assistant" else None


@dataclass(frozen=True)
class PrefillSpec:
    chunk_size: int = DEFAULT_CHUNK_SIZE
    reference_chunk_size: int | None = DEFAULT_CHUNK_SIZE  # None: the whole prompt in one piece


@dataclass(frozen=True)
class DecodeSpec:
    steps: int = 16
    tokens: str = "continuation"  # "continuation" | "greedy" | "ids"
    ids: tuple[int, ...] = ()  # when tokens == "ids"


@dataclass(frozen=True)
class ReferenceSpec:
    dtype: str = "float32"
    parity: tuple[str, ...] = ()

    def parity_options(self):
        """`reference.layer.ParityOptions` with the chosen switches on."""
        from reference.layer import ParityOptions

        return ParityOptions(**{switch.replace("-", "_"): True for switch in self.parity})


@dataclass(frozen=True)
class EngineSpec:
    indexer_fp4: bool = False

    def options(self):
        """`optimized.engine.EngineOptions` for the stock engine."""
        from optimized.engine import EngineOptions

        return EngineOptions(indexer_fp4=self.indexer_fp4)


@dataclass(frozen=True)
class VariantSpec:
    """One optimized stack: the base engine plus `patch_ids` (in order) with per-patch `options` as written."""

    name: str
    patch_ids: tuple[str, ...] = ()
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    patches_as_written: str | tuple[str, ...] = ()  # "all" / "none" or the list, for display

    def choices(self, registry):
        """The `PatchChoice`s for this variant from a registry built by `StacksSpec.registry()`."""
        return registry.choose(list(self.patch_ids), {pid: dict(opts) for pid, opts in self.options.items()})


@dataclass(frozen=True)
class StacksSpec:
    reference: ReferenceSpec = ReferenceSpec()
    yardstick: bool = True
    engine: EngineSpec = EngineSpec()
    variants: tuple[VariantSpec, ...] = ()
    patch_modules: tuple[str, ...] = ()  # absolute .py paths or module names

    def registry(self):
        """The patch registry: built-ins plus this scenario's plugin modules."""
        from optimized.registry import default_registry

        return default_registry(list(self.patch_modules))

    def variant(self, name: str) -> VariantSpec:
        for variant in self.variants:
            if variant.name == name:
                return variant
        raise KeyError(f"no variant {name!r}; variants: {[v.name for v in self.variants]}")


@dataclass(frozen=True)
class MeasureSpec:
    local: bool = True
    force_decisions: bool = False


@dataclass(frozen=True)
class DumpSpec:
    positions: tuple[int, ...] = ()
    taps: tuple[str, ...] = ()

    def tap_names(self) -> list[str]:
        """The canonical taps the patterns select, in canonical order."""
        return [tap for tap in CANONICAL_TAPS if any(fnmatch.fnmatchcase(tap, p) for p in self.taps)]


@dataclass(frozen=True)
class ProbesSpec:
    bin_size: int = 512
    attn_sample_every: int = 64
    logits_sample_every: int = 256
    dump: DumpSpec = DumpSpec()


@dataclass(frozen=True)
class GateSpec:
    policy: str | Path = "default"  # "default" or the policy file's absolute path


@dataclass(frozen=True)
class Scenario:
    name: str
    model: ModelSpec
    prompt: PromptSpec
    description: str = ""
    tokenizer: str | Path = "auto"  # "auto" | "fallback" | a directory holding tokenizer.json
    prefill: PrefillSpec = PrefillSpec()
    decode: DecodeSpec = DecodeSpec()
    stacks: StacksSpec = StacksSpec()
    measure: MeasureSpec = MeasureSpec()
    probes: ProbesSpec = ProbesSpec()
    gate: GateSpec = GateSpec()
    file: str = "<string>"  # where it was read from, for messages
    field_lines: Mapping[str, int] = field(default_factory=dict, repr=False, compare=False)

    def line_of(self, field_path: str) -> int:
        """The line a field was written on; for a defaulted field, its nearest written parent's line."""
        path = field_path
        while path:
            if path in self.field_lines:
                return self.field_lines[path]
            path = re.sub(r"(\.[^.\[\]]+|\[\d+\])$", "", path) if re.search(r"[.\[]", path) else ""
        return 1

    def where(self, field_path: str) -> str:
        return f"{self.file}:{self.line_of(field_path)}"

    def error(self, field_path: str, problem: str) -> ScenarioError:
        """A ScenarioError pointing at a field, for problems found after loading (e.g. when the prompt is resolved)."""
        return ScenarioError([Issue(self.file, self.line_of(field_path), field_path, problem)])


