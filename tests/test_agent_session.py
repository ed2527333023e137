"""The agent-session prompt generator: deterministic, on target, with turns and needles the lens can use."""

import pytest

from harness.scenario.agent_session import generate_agent_session
from harness.scenario.tokenizer import (
    ASSISTANT,
    EOS,
    SPECIAL_TOKEN_IDS,
    THINK_END,
    THINK_START,
    USER,
    VOCAB_SIZE,
    FallbackTokenizer,
)

SHAPES = [(10_000, 4), (27_000, 8), (30_000, 12)]  # the shipped scenario sizes (DESIGN §7)


@pytest.fixture(scope="module")
def sessions():
    return {
        target: generate_agent_session(seed=11, target_tokens=target, turns=turns, tokenizer=FallbackTokenizer())
        for target, turns in SHAPES
    }


def test_same_seed_gives_identical_ids_different_seed_does_not():
    first = generate_agent_session(3, 10_000, 4, FallbackTokenizer())
    again = generate_agent_session(3, 10_000, 4, FallbackTokenizer())
    other = generate_agent_session(4, 10_000, 4, FallbackTokenizer())
    assert first.ids == again.ids and first.text == again.text
    assert first.ids != other.ids


@pytest.mark.parametrize("target, turns", SHAPES)
def test_prompt_length_within_two_percent_of_target(sessions, target, turns):
    length = len(sessions[target].ids)
    assert abs(length - target) <= 0.02 * target, f"target {target} tokens, got {length}"


@pytest.mark.parametrize("target, turns", SHAPES)
def test_turn_count_is_respected(sessions, target, turns):
    session = sessions[target]
    assert session.encoded.num_turns == turns
    assert sum(1 for span in session.spans if span.role == "user") == turns
    assert [turn.turn for turn in session.turn_spans] == list(range(-1, turns))


@pytest.mark.parametrize("target, turns", SHAPES)
def test_every_id_is_inside_the_vocabulary(sessions, target, turns):
    ids = sessions[target].ids
    assert all(0 <= token_id < VOCAB_SIZE for token_id in ids), max(ids)
    for token in (USER, ASSISTANT, THINK_START, THINK_END, EOS):
        assert SPECIAL_TOKEN_IDS[token] in ids, f"{token} never appears in the session"


def test_chat_mode_session_has_no_thinking_opener():
    session = generate_agent_session(5, 8_000, 3, FallbackTokenizer(), thinking=False)
    assert SPECIAL_TOKEN_IDS[THINK_START] not in session.ids
    assert session.ids[-2:] == [SPECIAL_TOKEN_IDS[ASSISTANT], SPECIAL_TOKEN_IDS[THINK_END]]


@pytest.mark.parametrize("target, turns", SHAPES)
def test_needles_are_planted_early_spanned_exactly_and_asked_later(sessions, target, turns):
    session = sessions[target]
    assert len(session.facts) == 3 and set(session.needle_spans) == {fact.name for fact in session.facts}
    last_request = [m for m in session.messages if m.role == "user"][-1].content
    for fact in session.facts:
        span = session.needle_spans[fact.name]
        assert span.turn == fact.planted_turn < turns // 2 + 1, f"{fact.name} planted in turn {span.turn}"
        assert fact.asked_turns == (turns - 1,) and fact.question in last_request
        covered = session.encoded.span_text(span.start, span.end)
        assert fact.text in covered, f"{fact.name}: span covers {covered!r}, not {fact.text!r}"
        assert fact.text not in session.encoded.span_text(span.start + 1, span.end)
        assert fact.text not in session.encoded.span_text(span.start, span.end - 1)


def test_many_needles_get_distinct_names():
    session = generate_agent_session(2, 20_000, 6, FallbackTokenizer(), needles=8)
    assert len(session.needle_spans) == 8, sorted(session.needle_spans)


def test_session_contains_an_interrupted_think_trace(sessions):
    session = sessions[27_000]
    interrupted = [i for i, m in enumerate(session.messages) if m.interrupted]
    assert interrupted, "a multi-turn session must contain an interrupted reasoning trace"
    span = next(s for s in session.spans if s.message_index == interrupted[0])
    ids = session.ids[span.start : span.end]
    assert ids[:2] == [SPECIAL_TOKEN_IDS[ASSISTANT], SPECIAL_TOKEN_IDS[THINK_START]]
    assert SPECIAL_TOKEN_IDS[THINK_END] not in ids and SPECIAL_TOKEN_IDS[EOS] not in ids
    assert session.ids[span.end] == SPECIAL_TOKEN_IDS[USER], "the user's next request follows the cut-off trace"


def test_tool_results_carry_most_of_the_tokens(sessions):
    session = sessions[30_000]
    tool_tokens = sum(span.end - span.start for span in session.spans if span.role == "tool")
    assert tool_tokens > 0.5 * len(session.ids), f"tool results are {tool_tokens} of {len(session.ids)} tokens"


def test_target_too_small_for_the_turns_is_a_clear_error():
    with pytest.raises(ValueError, match="too small for 10 turns"):
        generate_agent_session(0, 2_000, 10, FallbackTokenizer())
