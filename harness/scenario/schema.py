"""Scenarios: what to run, as a validated YAML file (DESIGN §7).

A scenario names the model, the prompt, the stacks and patches, the probes and the gate policy. The models below
describe the file: each field's description is its documentation and lands in the JSON Schema
(`dsv4-drift scenarios schema`, shipped as scenarios/scenario.schema.json) that editors read through the
`# yaml-language-server: $schema=…` line. `harness.scenario.load.load_scenario(path)` reads a file and reports its
problems as `file:line: field.path: problem` in a `ScenarioError` (exit code 2 in the CLI): every field's at once,
and a section's cross-field rules once its fields are valid. YAML is read as plain data only
(`harness.scenario.yaml_source`): a tag like `!!python/object` is an error, never code. Relative paths resolve
against the scenario file's directory. `resolve_prompt(scenario)` turns the prompt section into token ids, turn
spans and needle spans (`harness.scenario.prompt`).

Patch ids and options are checked against the patch registry — the built-ins plus the scenario's plugin modules —
at load time, so a typo fails before any model is built, naming the variant. Only name, model and prompt are
required; README, Scenario format, shows a whole scenario.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import (AfterValidator, ConfigDict, Discriminator, Field, PlainValidator, PrivateAttr, Tag,
                      ValidationInfo, WithJsonSchema, field_validator, model_validator)

from harness.scenario.chat_encoding import ROLES, Message, ToolCall, render_chat
from reference.weights.profiles import DEFAULT_PROFILE, PROFILES

SYNTHETIC_PROFILES = tuple(PROFILES)
from harness.scenario.validation import (Bool, FileModel, Model, NonNegInt, PositiveInt, Str, describe, matching,
                                         not_one_of, problem, suggest)

NAME_PATTERN = re.compile(r"[a-z0-9-]+")
VARIANT_NAME_PATTERN = re.compile(r"[a-z0-9+._-]+")
TAP_PATTERN = re.compile(r"[a-z0-9_.*?\[\]-]+")
DTYPES = ("float32", "float64")
PARITY_SWITCHES = ("fp8-kv", "indexer-fp4")
TOKENIZER_KEYWORDS = ("auto", "fallback")
DECODE_KEYWORDS = ("continuation", "greedy")
PROMPT_SOURCES = ("messages", "token_file", "generator")
DEFAULT_CHUNK_SIZE = 8192  # optimized-stack §7: the deployed --chunked-prefill-size
CANONICAL_TAPS = (
    # reference/probes.py lists these; every stack emits them. `logits` is the final-norm head output.
    "layer.in", "attn.hc", "ffn.hc", "attn.q", "attn.kv", "compressor.rows", "indexer.rows", "indexer.scores",
    "indexer.selected", "attn.probs", "attn.lse", "attn.out", "moe.router", "moe.out", "layer.out", "logits",
)


# --------------------------------------------------------------------------- value types


def _base_dir(info: ValidationInfo) -> Path:
    return Path((info.context or {}).get("base_dir") or Path.cwd())


def _path(kind: str, keywords: tuple[str, ...] = (), holding: str = "") -> Any:
    """One of `keywords`, or a file or directory (kind) relative to the scenario file that exists, holding `holding`."""
    def check(value: Any, info: ValidationInfo) -> str | Path:
        if isinstance(value, str) and value in keywords:
            return value
        if not isinstance(value, str):
            raise problem(f"expected a string, got {describe(value)}")
        resolved = (_base_dir(info) / Path(value).expanduser()).resolve()
        if not (resolved.is_dir() if kind == "directory" else resolved.is_file()):
            raise problem(f"{kind} {value!r} does not exist (looked for {resolved})")
        if holding and not (resolved / holding).is_file():
            raise problem(f"{resolved} holds no {holding} (expected {', '.join(keywords)} or a {kind} with {holding})")
        return resolved
    written = {"anyOf": [{"enum": list(keywords)}, {"type": "string"}]} if keywords else {"type": "string"}
    return Annotated[Union[str, Path] if keywords else Path, PlainValidator(check), WithJsonSchema(written)]


def _unique(values: tuple) -> tuple:
    for index, value in enumerate(values):
        if value in values[:index]:
            raise problem(f"{value!r} is listed twice", at=(index,))
    return values


def _keyword_or_list(keywords: tuple[str, ...], item: Any) -> Any:
    """One of a few words, or a list: one field, two shapes, told apart by the value's type."""
    return Annotated[Union[Annotated[Literal[keywords], Tag("keyword")], Annotated[tuple[item, ...], Tag("list")]],
                     Discriminator(lambda value: "keyword" if isinstance(value, str) else "list")]


def _presets() -> list[str]:
    from reference.config import PRESETS  # imports torch: only when a scenario is read, never when the gate is

    return sorted(PRESETS)


def _preset(name: str) -> str:
    if name not in _presets():
        raise problem(not_one_of(name, _presets()))
    return name


def _tap_pattern(text: str) -> str:
    if not any(fnmatch.fnmatchcase(tap, text) for tap in CANONICAL_TAPS):
        raise problem(f"{text!r} matches no tap{suggest(text, CANONICAL_TAPS)} (taps: {', '.join(CANONICAL_TAPS)})")
    return text


TapPattern = Annotated[matching(TAP_PATTERN, "tap name or pattern"), AfterValidator(_tap_pattern)]


# --------------------------------------------------------------------------- the scenario tree


class ModelSpec(Model):
    """Exactly one of preset (synthetic weights) or checkpoint (a directory)."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["preset"]}, {"required": ["checkpoint"]}]})
    preset: Annotated[Str, AfterValidator(_preset)] | None = Field(
        None, description="synthetic weights for a preset of reference.config.PRESETS",
        json_schema_extra=lambda schema: schema.update(enum=_presets()))
    seed: NonNegInt = Field(0, description="synthetic weight seed (presets only)")
    profile: Literal[SYNTHETIC_PROFILES] = Field(
        DEFAULT_PROFILE, description="synthetic weight statistics (presets only): calibrated (public evidence, planted "
                                     "retrieval circuits; the default), calibrated-2026-12-04 (calibrated before its "
                                     "SwiGLU clamp channels) or uncalibrated (the generator before 2026-12-01), the "
                                     "last two for reproducing earlier runs")
    checkpoint: _path("directory") | None = Field(None, description="a checkpoint directory (config.json, "
                                                                    "safetensors)")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.preset is None) == (self.checkpoint is None):
            raise problem("give exactly one of preset (synthetic weights) or checkpoint (a directory)")
        for key in ("seed", "profile"):
            if self.checkpoint is not None and key in self.model_fields_set:
                raise problem(f"{key} applies to synthetic weights (preset) only", at=(key,))
        return self

    def config(self):
        """The model's `reference.config.ModelConfig` (a checkpoint's config.json is read, no weights)."""
        from reference.config import get_preset, load_config_json

        return get_preset(self.preset) if self.preset else load_config_json(self.checkpoint / "config.json")

    def open_weights(self):
        """The weight source (`harness.scenario.weights.open_weights`): synthetic for a preset, else the checkpoint."""
        from harness.scenario.weights import open_weights

        return open_weights(self.preset, self.seed, self.checkpoint, self.profile)


class GeneratorSpec(Model):
    """A synthetic coding-agent session (harness.scenario.agent_session)."""

    kind: Literal["agent-session"] = Field("agent-session", description="the only kind")
    seed: NonNegInt = 0
    target_tokens: PositiveInt = Field(description="the prompt lands within 0.5% of it")
    turns: PositiveInt = Field(4, description="user requests")
    needles: NonNegInt = Field(3, description="facts planted in the first half of the turns, asked about in the last")
    thinking: Bool = True


class ToolCallSpec(Model):
    name: Str
    arguments: dict[str, Any] = {}


class MessageSpec(Model):
    """One chat message, rendered with DeepSeek-V4's encoding (spec §9)."""

    role: Literal[ROLES] = Field(description="system only first")
    content: Str = ""
    reasoning: Str | None = Field(None, description="assistant only: the <think> text")
    interrupted: Bool = Field(False, description="assistant only: generation was cut off")
    tool_calls: tuple[ToolCallSpec, ...] = Field((), description="assistant only: e.g. {name: read_file, "
                                                                 "arguments: {path: a.py}}")
    tools: tuple[dict[str, Any], ...] = Field((), description="system only: tool definitions (JSON schemas)")
    needles: dict[str, Annotated[Str, Field(min_length=1)]] = Field(
        {}, description="needle name → a substring of this message's rendered text")

    def message(self) -> Message:
        calls = tuple(ToolCall(call.name, dict(call.arguments)) for call in self.tool_calls)
        return Message(self.role, self.content, self.reasoning, calls, self.tools, self.interrupted,
                       dict(self.needles))


def _needle_span(span: tuple[int, ...]) -> tuple[int, ...]:
    if len(span) != 2 or span[1] <= span[0]:
        raise problem(f"expected [start, end) with start < end, got {list(span)}")
    return span


_SOURCE_ONLY_KEYS = {"messages": ("thinking", "keep_earlier_reasoning"),
                     "token_file": ("decode_token_file", "turn_starts", "needle_spans"), "generator": ()}


class PromptSpec(Model):
    """Exactly one source: `messages`, `token_file` or `generator` (named by `source`)."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": [source]} for source in PROMPT_SOURCES]})
    messages: tuple[MessageSpec, ...] = Field(
        (), min_length=1, description="an explicit chat; a final assistant message is the decode continuation "
                                      "(decode.tokens: continuation), not prompt")
    thinking: Bool = Field(True, description="messages only: thinking mode (spec §9)")
    keep_earlier_reasoning: Bool = Field(False, description="messages only: keep the reasoning of earlier turns")
    token_file: _path("file") | None = Field(None, description="a JSON list of prompt token ids")
    decode_token_file: _path("file") | None = Field(
        None, description="token_file only: the decode ids for decode.tokens: continuation")
    turn_starts: tuple[NonNegInt, ...] = Field(
        (), description="token_file only: first position of each turn (before it: preamble, turn -1); empty means "
                        "the whole prompt is turn 0")
    needle_spans: dict[str, Annotated[tuple[NonNegInt, ...], AfterValidator(_needle_span)]] = Field(
        {}, description="token_file only: needle name → token range [start, end)")
    generator: GeneratorSpec | None = None

    @field_validator("turn_starts")
    @classmethod
    def _increasing(cls, starts: tuple[int, ...]) -> tuple[int, ...]:
        for index, (before, after) in enumerate(zip(starts, starts[1:]), 1):
            if after <= before:
                raise problem(f"turn starts must increase; {after} follows {before}", at=(index,))
        return starts

    @model_validator(mode="before")
    @classmethod
    def _one_source(cls, data: Any) -> Any:
        """Checked first: with two sources (or none) nothing else about the prompt is worth reporting."""
        given = [source for source in PROMPT_SOURCES if isinstance(data, dict) and source in data]
        if isinstance(data, dict) and len(given) != 1:
            got = f"; got {' and '.join(given)}" if given else ""
            raise problem(f"give exactly one prompt source: {', '.join(PROMPT_SOURCES)}{got}",
                          line_at=[(source,) for source in given])
        return data

    @model_validator(mode="after")
    def _source_fields(self) -> PromptSpec:
        for other, keys in _SOURCE_ONLY_KEYS.items():
            for key in keys:
                if key in self.model_fields_set and other != self.source:
                    raise problem(f"applies to {other} prompts only, this prompt uses {self.source}", at=(key,))
        if self.source == "messages":
            self._check_chat()
        return self

    def _check_chat(self) -> None:
        last = len(self.messages) - 1
        if self.messages[last].role == "assistant" and self.messages[last].needles:
            raise problem("a final assistant message is the decode continuation, not prompt: needles must be in the "
                          "prompt", at=("messages", last, "needles"))
        options = dict(thinking=self.thinking, keep_earlier_reasoning=self.keep_earlier_reasoning)
        try:
            render_chat(self.prompt_messages, **options)
            render_chat(self.chat_messages, **options)
        except ValueError as e:  # chat_encoding names the message: "message 3 (tool): …"
            found = re.match(r"message (\d+)", str(e))
            raise problem(re.sub(r"^message \d+( \(\w+\))?: ", "", str(e)),
                          at=("messages", int(found.group(1)) if found else 0)) from None

    @property
    def source(self) -> str:
        return next((source for source in PROMPT_SOURCES if source in self.model_fields_set), "messages")

    @property
    def chat_messages(self) -> tuple[Message, ...]:
        """Every message, the continuation included, as the chat encoding takes them."""
        return tuple(message.message() for message in self.messages)

    @property
    def prompt_messages(self) -> tuple[Message, ...]:
        """The messages that form the prompt: all but a final assistant message (that one is the continuation)."""
        chat = self.chat_messages
        return chat[:-1] if chat and chat[-1].role == "assistant" else chat

    @property
    def continuation_message(self) -> Message | None:
        chat = self.chat_messages
        return chat[-1] if chat and chat[-1].role == "assistant" else None


class PrefillSpec(Model):
    chunk_size: PositiveInt = Field(DEFAULT_CHUNK_SIZE, description="optimized stacks prefill in chunks of this "
                                                                    "many tokens")
    reference_chunk_size: PositiveInt | None = Field(
        default_factory=lambda data: data.get("chunk_size", DEFAULT_CHUNK_SIZE),
        description="[= chunk_size] the reference's chunks; null = the whole prompt at once (the reference's "
                    "results do not depend on chunking, DESIGN §3)")


class DecodeSpec(Model):
    tokens: _keyword_or_list(DECODE_KEYWORDS, NonNegInt) = Field(
        "continuation", description="continuation: the text that comes next (the generator's continuation, a final "
                                    "assistant message, or decode_token_file) | greedy: the reference's argmax, "
                                    "computed by the runner | [id, id, …] (model ids, exactly `steps` of them)")
    steps: NonNegInt = Field(
        default_factory=lambda data: len(data["tokens"]) if isinstance(data.get("tokens"), tuple) else 16,
        description="[16, or the length of an id list] teacher-forced decode steps; 0 = prefill only")

    @model_validator(mode="after")
    def _ids_for_every_step(self) -> DecodeSpec:
        if self.source == "ids" and len(self.ids) != self.steps:
            raise problem(f"{len(self.ids)} ids given for {self.steps} decode steps", at=("tokens",))
        return self

    @property
    def source(self) -> str:
        """continuation | greedy | ids"""
        return "ids" if isinstance(self.tokens, tuple) else self.tokens

    @property
    def ids(self) -> tuple[int, ...]:
        return self.tokens if isinstance(self.tokens, tuple) else ()


class ReferenceSpec(Model):
    dtype: Literal[DTYPES] = "float32"
    parity: Annotated[tuple[Literal[PARITY_SWITCHES], ...], AfterValidator(_unique)] = Field(
        (), description="official QAT steps (spec §7) to switch on")

    def parity_options(self):
        """`reference.layer.ParityOptions` with the chosen switches on."""
        from reference.layer import ParityOptions

        return ParityOptions(**{switch.replace("-", "_"): True for switch in self.parity})


class EngineSpec(Model):
    indexer_fp4: Bool = Field(False, description="the stock engine stores indexer keys as FP4 (optimized-stack)")

    def options(self):
        """`optimized.engine.EngineOptions` for the stock engine."""
        from optimized.engine import EngineOptions

        return EngineOptions(indexer_fp4=self.indexer_fp4)


def _registry(info: ValidationInfo):
    """The registry variants are checked against: StacksSpec.patch_modules, validated before the variants, leaves
    the built-ins plus the scenario's plugins in the context; without plugins, the built-ins."""
    context = info.context if isinstance(info.context, dict) else {}
    if "registry" not in context:
        from optimized.registry import default_registry

        context["registry"] = default_registry()
    return context["registry"]


class VariantSpec(Model):
    """One optimized stack: the base engine plus `patch_ids` (in order) with per-patch `options` as written."""

    name: matching(VARIANT_NAME_PATTERN, "variant name")
    patches: _keyword_or_list(("all", "none"), Str) = Field(
        (), description="all (every built-in patch) | none | a list of patch ids")
    options: dict[str, dict[str, Any]] = Field({}, description="per selected patch, e.g. {triton-indexer: "
                                                               "{prefill_rows: true}}")
    _patch_ids: tuple[str, ...] = PrivateAttr(())

    @model_validator(mode="after")
    def _check_against_registry(self, info: ValidationInfo) -> VariantSpec:
        from optimized.patching import PatchError

        registry, where = _registry(info), f"variant {self.name!r}"
        if self.patches in ("all", "none"):
            self._patch_ids = tuple(registry.built_in_ids()) if self.patches == "all" else ()
        known = registry.ids()
        for index, pid in enumerate(self.patches if isinstance(self.patches, tuple) else ()):
            if pid not in known:
                raise problem(f"{where}: unknown patch {pid!r}{suggest(pid, known)} (known: {', '.join(known)})",
                              at=("patches", index))
            if pid in self.patches[:index]:
                raise problem(f"{where}: patch {pid!r} is listed twice", at=("patches", index))
            self._patch_ids += (pid,)
        for pid, options in self.options.items():
            if pid not in self._patch_ids:
                raise problem(f"{where}: options for patch {pid!r}, which this variant does not select"
                              f"{suggest(pid, self._patch_ids)} (selected: {', '.join(self._patch_ids) or 'none'})",
                              at=("options", pid))
            self._check_options(registry.get(pid), options, where)
        try:  # the registry's own check, so a scenario accepts exactly what the engine will
            self.choices(registry)
        except PatchError as e:
            raise problem(f"{where}: {e}") from None
        return self

    @staticmethod
    def _check_options(patch, options: dict[str, Any], where: str) -> None:
        known = sorted(patch.defaults)
        for key, value in options.items():
            at = ("options", patch.id, key)
            if key not in patch.defaults:
                raise problem(f"{where}: patch {patch.id!r} has no option {key!r}{suggest(key, known)} "
                              f"(options: {', '.join(known) or 'none'})", at=at)
            complaint = patch.option_problem(key, value)  # the patch's own choices (a string "false" is not false)
            if complaint:
                raise problem(f"{where}: patch {patch.id!r}: {complaint}", at=at)

    @property
    def patch_ids(self) -> tuple[str, ...]:
        return self._patch_ids

    def choices(self, registry):
        """The `PatchChoice`s for this variant from a registry built by `StacksSpec.registry()`."""
        return registry.choose(list(self.patch_ids), {pid: dict(opts) for pid, opts in self.options.items()})


def _default_variants() -> tuple[VariantSpec, ...]:
    return VariantSpec(name="base"), VariantSpec(name="all", patches="all")


class StacksSpec(Model):
    reference: ReferenceSpec = ReferenceSpec()
    yardstick: Bool = Field(True, description="also run the naive-bf16 noise-floor stack")
    engine: EngineSpec = EngineSpec()
    patch_modules: tuple[Str, ...] = Field(
        (), description="plugin .py files (relative to this file) or importable modules that define patches")
    variants: tuple[VariantSpec, ...] = Field(
        default_factory=_default_variants, min_length=1,
        description="[base (no patches) and all] the optimized stacks, names unique")

    @field_validator("patch_modules")
    @classmethod
    def _load_plugins(cls, specs: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        """Each plugin loaded on its own, so a failure names its entry; the registry is left for the variants."""
        from optimized.patching import PatchError, load_plugin
        from optimized.registry import default_registry

        registry = _registry(info)  # the built-ins, plus any plugins given beside the file (load_scenario)
        resolved = []
        for index, spec in enumerate(specs):
            if spec.endswith(".py") or "/" in spec or "\\" in spec:
                path = (_base_dir(info) / Path(spec).expanduser()).resolve()
                if not path.is_file():
                    raise problem(f"patch module file {spec!r} does not exist (looked for {path})", at=(index,))
                spec = str(path)
            try:
                load_plugin(registry, spec)
            except PatchError as e:
                raise problem(str(e), at=(index,)) from None
            resolved.append(spec)
        return tuple(resolved)

    @field_validator("variants")
    @classmethod
    def _unique_names(cls, variants: tuple[VariantSpec, ...]) -> tuple[VariantSpec, ...]:
        names = [variant.name for variant in variants]
        for index, name in enumerate(names):
            if name in names[:index]:
                raise problem(f"duplicate variant name {name!r}", at=(index, "name"),
                              first=(names.index(name), "name"))
        return variants

    def registry(self):
        """The patch registry: built-ins plus this scenario's plugin modules."""
        from optimized.registry import default_registry

        return default_registry(list(self.patch_modules))

    def variant(self, name: str) -> VariantSpec:
        for variant in self.variants:
            if variant.name == name:
                return variant
        raise KeyError(f"no variant {name!r}; variants: {[v.name for v in self.variants]}")


class MeasureSpec(Model):
    local: Bool = Field(True, description="also run each variant's layer on the reference's layer input")
    force_decisions: Bool = Field(False, description="also run with the reference's top-k and expert choices "
                                                     "forced in")


class DumpSpec(Model):
    positions: Annotated[tuple[NonNegInt, ...], AfterValidator(_unique)] = Field(
        (), description="absolute positions whose raw tap tensors are saved")
    taps: Annotated[tuple[TapPattern, ...], AfterValidator(_unique)] = Field(
        (), description="tap names or glob patterns (attn.*) of " + ", ".join(CANONICAL_TAPS))

    def tap_names(self) -> list[str]:
        """The canonical taps the patterns select, in canonical order."""
        return [tap for tap in CANONICAL_TAPS if any(fnmatch.fnmatchcase(tap, p) for p in self.taps)]


class ProbesSpec(Model):
    bin_size: PositiveInt = Field(512, description="position-bin width of the metrics (tokens)")
    attn_sample_every: PositiveInt = Field(64, description="attention-row metrics on every n-th query position "
                                                           "(and all decode steps)")
    logits_sample_every: PositiveInt = Field(256, description="logits metrics on every n-th prompt position (and "
                                                              "all decode steps)")
    dump: DumpSpec = DumpSpec()


class GateSpec(Model):
    policy: _path("file", ("default",)) = Field(
        "default", description="default (the built-in policy) or a policy YAML file")


class Scenario(FileModel):
    """A dsv4-drift scenario: what to run (DESIGN §7)."""

    name: matching(NAME_PATTERN, "scenario name") = Field(description="used for run directories")
    description: Str = Field("", description="one line shown by `scenarios list`")
    model: ModelSpec
    prompt: PromptSpec
    tokenizer: _path("directory", TOKENIZER_KEYWORDS, "tokenizer.json") = Field(
        "auto", description="auto (the checkpoint's tokenizer.json if present, else the deterministic fallback) | "
                            "fallback | a directory holding tokenizer.json")
    prefill: PrefillSpec = PrefillSpec()
    decode: DecodeSpec = DecodeSpec()
    stacks: StacksSpec = Field(default_factory=StacksSpec)
    measure: MeasureSpec = MeasureSpec()
    probes: ProbesSpec = ProbesSpec()
    gate: GateSpec = GateSpec()

    @model_validator(mode="after")
    def _decode_source(self) -> Scenario:
        """decode.tokens: continuation needs something to continue, and a continuation source needs that mode."""
        prompt, tokens, at = self.prompt, self.decode.source, ("decode", "tokens")
        label = tokens if "tokens" in self.decode.model_fields_set else f"{tokens} (the default)"
        final_assistant = prompt.continuation_message is not None
        if prompt.source == "messages" and final_assistant and tokens != "continuation":
            raise problem(f"the final assistant message is the continuation, but decode.tokens is {tokens}: remove "
                          "that message or use tokens: continuation", at=at)
        if tokens != "continuation" or self.decode.steps == 0:
            if prompt.decode_token_file is not None:
                raise problem("prompt.decode_token_file is given but decode.tokens is not continuation (with steps "
                              "> 0)", at=at)
        elif prompt.source == "messages" and not final_assistant:
            raise problem(f"{label} with explicit messages needs a final assistant message (its tokens are decoded); "
                          "or use tokens: greedy, a list of ids or steps: 0", at=at)
        elif prompt.source == "token_file" and prompt.decode_token_file is None:
            raise problem(f"{label} with a token_file prompt needs prompt.decode_token_file; or use tokens: greedy, "
                          "a list of ids or steps: 0", at=at)
        return self
