"""`dsv4-drift scenarios`: list the shipped scenarios, validate scenario files, render a scenario's prompt, print the
scenario JSON Schema.

    dsv4-drift scenarios list
    dsv4-drift scenarios validate scenarios/*.yaml my-scenario.yaml
    dsv4-drift scenarios render demo-cpu --max-chars 1500 --ids
    dsv4-drift scenarios schema > scenarios/scenario.schema.json

Scenario text comes from users, so it is never parsed as rich markup: everything user-written is
printed through `rich.text.Text` (a `[bold]` in a prompt prints as those seven characters).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from harness.errors import UsageError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "scenarios",
        help="list the shipped scenarios, validate scenario files, render a scenario's prompt, print the schema",
        description="Scenarios are YAML files naming the model, the prompt, the stacks and patches, the probes and "
                    "the gate policy (schema: `scenarios schema`, from harness/scenario/schema.py). A scenario "
                    "argument is a file path or the name of a shipped scenario (see `scenarios list`).",
    )
    verbs = p.add_subparsers(dest="scenarios_command", metavar="VERB")

    ls = verbs.add_parser("list", help="the scenarios shipped in the repository's scenarios/ directory",
                          description="A table of the shipped scenarios: model, prompt size, prefill chunks, "
                                      "decode steps, variants and description.")
    ls.set_defaults(func=run_list)

    validate = verbs.add_parser(
        "validate", help="check scenario files; print every problem as file:line: field: problem",
        description="Load each file with the full schema and patch-registry checks, then resolve its prompt "
                    "(token counts, needle spans, continuation, dump positions). Exit 0 when all are valid, "
                    "2 otherwise.")
    validate.add_argument("files", nargs="+", metavar="FILE", help="scenario files (or shipped scenario names)")
    validate.add_argument("--no-resolve", action="store_true",
                          help="check the file only, do not build the prompt (skips token files and generators)")
    validate.set_defaults(func=run_validate)

    render = verbs.add_parser(
        "render", help="show a scenario's prompt: turns, per-turn token counts, needles, decode continuation",
        description="The prompt text turn by turn with token ranges and counts, needle spans highlighted and the "
                    "decode continuation at the end. Long turns are elided in the middle, keeping needles visible.")
    render.add_argument("file", metavar="FILE", help="scenario file (or shipped scenario name)")
    render.add_argument("--max-chars", type=int, default=2000,
                        help="show at most about this many characters per turn (0: everything; default 2000)")
    render.add_argument("--ids", action="store_true", help="also print the model token ids of every turn")
    render.set_defaults(func=run_render)

    schema = verbs.add_parser(
        "schema", help="print the scenario JSON Schema (shipped as scenarios/scenario.schema.json)",
        description="The JSON Schema of scenario files, for editors: a first line "
                    "`# yaml-language-server: $schema=PATH` makes the YAML language server complete and check the "
                    "file as it is written. Regenerate the shipped copy with "
                    "`dsv4-drift scenarios schema > scenarios/scenario.schema.json`.")
    schema.set_defaults(func=run_schema)

    p.set_defaults(func=lambda args: _missing_verb(p))


def _missing_verb(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _console():
    from rich.console import Console

    return Console(highlight=False)


# --------------------------------------------------------------------------- list


def run_list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from harness.scenario import SCENARIOS_DIR, ScenarioError, load_scenario, resolve_prompt, shipped_scenarios

    console = _console()
    files = shipped_scenarios()
    if not files:
        raise UsageError(f"no scenario files in {SCENARIOS_DIR}")
    table = Table(title=Text(f"Shipped scenarios ({SCENARIOS_DIR})"), show_lines=False)
    for column in ("name", "model", "prompt tokens", "prefill chunks", "decode steps", "variants"):
        table.add_column(column, justify="left" if column in ("name", "model") else "right", no_wrap=True)
    table.add_column("description", ratio=1, overflow="fold", min_width=20)
    invalid = 0
    for path in files:
        try:
            scenario = load_scenario(path)
        except ScenarioError as e:
            invalid += 1
            table.add_row(Text(path.stem), "", "", "", "", "", Text(f"INVALID: {e.issues[0]}", style="red"))
            continue
        generator = scenario.prompt.generator
        if generator is not None:  # the generator lands within 0.5% of its target: no need to build it
            tokens = generator.target_tokens
            shown = f"~{tokens:,}"
        else:
            try:
                tokens = resolve_prompt(scenario).n_prompt
            except ScenarioError as e:
                invalid += 1
                table.add_row(Text(scenario.name), "", "", "", "", "", Text(f"INVALID: {e.issues[0]}", style="red"))
                continue
            shown = f"{tokens:,}"
        chunk = scenario.prefill.chunk_size
        table.add_row(
            Text(scenario.name, style="bold"),
            Text(scenario.model.preset or str(scenario.model.checkpoint)),
            shown,
            f"{-(-tokens // chunk)} × {chunk:,}",
            str(scenario.decode.steps),
            str(len(scenario.stacks.variants)),
            Text(scenario.description),
        )
    if not console.is_terminal:  # piped or logged: as wide as the table needs, so no cell is cut
        console = Console(highlight=False, width=max(80, Console(width=10_000).measure(table).maximum))
    console.print(table)
    return 2 if invalid else 0


# --------------------------------------------------------------------------- validate


def run_validate(args: argparse.Namespace) -> int:
    from harness.scenario import ScenarioError, find_scenario, load_scenario, resolve_prompt

    failed = 0
    for name in args.files:
        try:
            path = find_scenario(name)
            scenario = load_scenario(path)
            summary = "structure only" if args.no_resolve else resolve_prompt(scenario).summary()
        except ScenarioError as e:
            failed += 1
            for issue in e.issues:
                print(issue, file=sys.stderr)
            continue
        print(f"ok: {path}: {summary}")
    if failed:
        print(f"{failed} of {len(args.files)} scenario file(s) invalid", file=sys.stderr)
    return 2 if failed else 0


# --------------------------------------------------------------------------- schema


def run_schema(args: argparse.Namespace) -> int:
    from harness.scenario.schema import Scenario
    from harness.scenario.validation import schema_json

    sys.stdout.write(schema_json(Scenario))
    return 0


# --------------------------------------------------------------------------- render

_NEEDLE_STYLE = "bold black on yellow"
_SPECIAL_STYLE = "bold magenta"
_DECODE_STYLE = "green"
_ELISION_STYLE = "dim italic"


def _special_pattern() -> re.Pattern[str]:
    from harness.scenario.tokenizer import SPECIAL_TOKEN_IDS

    return re.compile("|".join(re.escape(t) for t in sorted(SPECIAL_TOKEN_IDS, key=len, reverse=True)))


def _styled(text: str, base_style: str, specials: re.Pattern[str]):
    """Text with the chat-format special tokens picked out; never parsed as markup."""
    from rich.text import Text

    out = Text()
    position = 0
    for match in specials.finditer(text):
        out.append(text[position: match.start()], style=base_style)
        out.append(match.group(), style=_SPECIAL_STYLE)
        position = match.end()
    out.append(text[position:], style=base_style)
    return out


def _keep_intervals(length: int, needles: list[tuple[int, int]], max_chars: int) -> list[tuple[int, int]]:
    """Character ranges of a turn to show: its head, its tail and some context around each needle."""
    if max_chars <= 0 or length <= max_chars:
        return [(0, length)]
    context = max(40, max_chars // 8)
    wanted = [(0, max_chars // 2), (length - max_chars // 4, length)]
    wanted += [(max(0, start - context), min(length, end + context)) for start, end in needles]
    merged: list[tuple[int, int]] = []
    for start, end in sorted(wanted):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _turn_text(plan, start: int, end: int, max_chars: int, specials: re.Pattern[str]):
    """The text of prompt tokens [start, end) with needles highlighted and the middle elided past max_chars."""
    from rich.text import Text

    # cut the turn at needle boundaries, so each piece is plain or needle
    cuts = {start, end}
    inside = [(loc.start, loc.end) for loc in plan.needles.values() if loc.start < end and loc.end > start]
    for needle_start, needle_end in inside:
        cuts.update((max(start, needle_start), min(end, needle_end)))
    bounds = sorted(cuts)
    pieces: list[tuple[str, bool]] = []
    for a, b in zip(bounds, bounds[1:]):
        is_needle = any(ns <= a and b <= ne for ns, ne in inside)
        pieces.append((_piece_text(plan, a, b), is_needle))

    # needle character ranges within the turn, for the elision windows
    needle_chars, position = [], 0
    for text, is_needle in pieces:
        if is_needle:
            needle_chars.append((position, position + len(text)))
        position += len(text)
    keep = _keep_intervals(position, needle_chars, max_chars)

    out = Text()
    shown_until = 0
    for keep_start, keep_end in keep:
        if keep_start > shown_until:
            out.append(f"\n  ⋯ {keep_start - shown_until:,} characters elided ⋯\n", style=_ELISION_STYLE)
        offset = 0
        for text, is_needle in pieces:
            piece_start, piece_end = offset, offset + len(text)
            offset = piece_end
            lo, hi = max(piece_start, keep_start), min(piece_end, keep_end)
            if lo < hi:
                out.append_text(_styled(text[lo - piece_start: hi - piece_start],
                                        _NEEDLE_STYLE if is_needle else "", specials))
        shown_until = keep_end
    if shown_until < position:
        out.append(f"\n  ⋯ {position - shown_until:,} characters elided ⋯", style=_ELISION_STYLE)
    return out


def _piece_text(plan, start: int, end: int) -> str:
    """Exact text of tokens [start, end) including any characters between them and the next token."""
    if plan.token_offsets is None:
        return plan.token_text(start, end)
    first = plan.token_offsets[start][0]
    last = plan.token_offsets[end][0] if end < plan.n_prompt else len(plan.text)
    return plan.text[first:last]


def _ids_text(ids: list[int], max_chars: int):
    from rich.text import Text

    shown = ", ".join(map(str, ids))
    if max_chars > 0 and len(shown) > max_chars:
        head = ", ".join(map(str, ids[: max(1, max_chars // 12)]))
        tail = ", ".join(map(str, ids[-max(1, max_chars // 24):]))
        shown = f"{head}, … {len(ids):,} ids …, {tail}"
    return Text(f"ids: [{shown}]", style="dim")


def run_render(args: argparse.Namespace) -> int:
    from rich.rule import Rule
    from rich.table import Table
    from rich.text import Text

    from harness.scenario.chat_encoding import PREAMBLE_TURN
    from harness.scenario import find_scenario, load_scenario, resolve_prompt
    from harness.scenario.prompt import span_text

    if args.max_chars < 0:
        raise UsageError(f"--max-chars must be 0 (everything) or positive, got {args.max_chars}")
    scenario = load_scenario(find_scenario(args.file))
    plan = resolve_prompt(scenario)
    console = _console()
    specials = _special_pattern()

    console.print(Rule(Text(f"scenario {scenario.name}: {Path(scenario.file)}")))
    console.print(Text(plan.summary()), soft_wrap=True)

    turns = Table(title=Text("turns"), title_justify="left")
    for column in ("turn", "tokens", "positions", "chunks"):
        turns.add_column(column, justify="right")
    for span in plan.turn_spans:
        chunks = sorted({plan.chunk_of_position(span.start), plan.chunk_of_position(span.end - 1)})
        turns.add_row("preamble" if span.turn == PREAMBLE_TURN else str(span.turn), f"{span.end - span.start:,}",
                      span_text(span.start, span.end), "–".join(map(str, chunks)))
    turns.add_row("decode", str(plan.decode_steps), span_text(plan.n_prompt, plan.n_total)
                  if plan.decode_steps else "", "")
    console.print(turns)

    if plan.needles:
        needles = Table(title=Text("needles"), title_justify="left")
        for column in ("name", "positions", "turn", "text"):
            needles.add_column(column)
        for name, loc in plan.needles.items():
            needles.add_row(Text(name), span_text(loc.start, loc.end), str(loc.turn),
                            Text(plan.needle_texts.get(name, ""), style=_NEEDLE_STYLE))
        console.print(needles)

    for span in plan.turn_spans:
        label = "preamble (BOS, system prompt)" if span.turn == PREAMBLE_TURN else f"turn {span.turn}"
        title = f"{label}: {span.end - span.start:,} tokens, positions {span_text(span.start, span.end)}"
        console.print(Rule(Text(title), align="left"))
        console.print(_turn_text(plan, span.start, span.end, args.max_chars, specials), soft_wrap=True)
        if args.ids:
            console.print(_ids_text(plan.prompt_ids[span.start: span.end], args.max_chars), soft_wrap=True)

    console.print(Rule(Text(f"decode: {plan.decode_steps} steps ({plan.decode_source})"), align="left"))
    if plan.decode_source == "greedy":
        console.print(Text("(the reference's greedy choice, computed when the scenario runs)", style="dim"))
    elif plan.decode_steps:
        console.print(_styled(plan.decode_text or "", _DECODE_STYLE, specials), soft_wrap=True)
        if args.ids:
            console.print(_ids_text(plan.decode_ids or [], args.max_chars), soft_wrap=True)
    return 0
