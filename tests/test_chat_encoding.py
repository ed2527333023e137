"""DeepSeek-V4 chat encoding (spec §9), its token spans, and the tokenizers behind it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.scenario.chat_encoding import Message, ToolCall, encode_chat, render_chat
from harness.scenario.tokenizer import (
    ASSISTANT,
    BOS,
    EOS,
    SPECIAL_TOKEN_IDS,
    THINK_END,
    THINK_START,
    USER,
    FallbackTokenizer,
    HFTokenizer,
    TokenizerSpecError,
    load_tokenizer,
)

SPEC_EXAMPLE = "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜><think>"
SPEC_MESSAGES = [Message("system", "You are a helpful assistant."), Message("user", "What is 2+2?")]


def two_turn_chat(**system_fields) -> list[Message]:
    return [
        Message("system", "Be brief.", **system_fields),
        Message("user", "Name a prime."),
        Message("assistant", "7", reasoning="Small primes: 2, 3, 5, 7."),
        Message("user", "Another one?"),
        Message("assistant", "11", reasoning="Next after 7 is 11."),
    ]


def test_spec_example_renders_exactly():
    assert render_chat(SPEC_MESSAGES, thinking=True) == SPEC_EXAMPLE


def test_spec_example_ids_put_special_tokens_in_place():
    encoded = encode_chat(SPEC_MESSAGES, FallbackTokenizer(), thinking=True)
    ids = encoded.ids
    assert ids[0] == 0, f"prompt must start with BOS id 0, got {ids[:3]}"
    assert ids.count(128803) == 1 and ids.count(128804) == 1, ids
    user_at = ids.index(128803)
    assert 1 < user_at < len(ids) - 2, "the system prompt's tokens sit between BOS and <｜User｜>"
    assert ids[-2:] == [128804, 128821], f"thinking-mode prompt must end <｜Assistant｜><think>, got {ids[-2:]}"
    assert encoded.span_text(1, user_at) == "You are a helpful assistant."


def test_chat_mode_generation_prompt_closes_thinking():
    assert render_chat(SPEC_MESSAGES, thinking=False).endswith(ASSISTANT + THINK_END)


def test_thinking_mode_drops_reasoning_of_earlier_turns():
    text = render_chat(two_turn_chat(), thinking=True)
    assert "Small primes" not in text, "reasoning before the last user message must be dropped"
    assert f"{ASSISTANT}{THINK_END}7{EOS}" in text
    assert f"{ASSISTANT}{THINK_START}Next after 7 is 11.{THINK_END}11{EOS}" in text


@pytest.mark.parametrize(
    "system_fields, keep",
    [({"tools": ({"name": "calc", "parameters": {}},)}, False), ({}, True)],
    ids=["tools-defined", "keep-option"],
)
def test_earlier_reasoning_kept_with_tools_or_on_request(system_fields, keep):
    text = render_chat(two_turn_chat(**system_fields), thinking=True, keep_earlier_reasoning=keep)
    assert f"{ASSISTANT}{THINK_START}Small primes: 2, 3, 5, 7.{THINK_END}7{EOS}" in text


def test_chat_mode_never_shows_reasoning():
    text = render_chat(two_turn_chat(), thinking=False, keep_earlier_reasoning=True)
    assert "Small primes" not in text and "Next after" not in text
    assert THINK_START not in text


def tool_chat() -> list[Message]:
    call = ToolCall("grep", {"pattern": "def main", "max_hits": 2})
    return [
        Message("system", "Agent.", tools=({"name": "grep", "parameters": {}},)),
        Message("user", "Where is main?"),
        Message("assistant", "Searching.", reasoning="Use grep.", tool_calls=(call,)),
        Message("tool", "app.py:3:def main():"),
        Message("tool", "cli.py:9:def main():"),
    ]


def test_tool_results_are_merged_into_one_user_block():
    encoded = encode_chat(tool_chat(), FallbackTokenizer())
    expected_tail = (
        f"{EOS}{USER}<tool_result>app.py:3:def main():</tool_result>\n\n"
        f"<tool_result>cli.py:9:def main():</tool_result>{ASSISTANT}{THINK_START}"
    )
    assert encoded.text.endswith(expected_tail), encoded.text[-200:]
    tool_spans = [span for span in encoded.spans if span.role == "tool"]
    assert [span.turn for span in tool_spans] == [0, 0], "tool results belong to the turn of the request"
    assert encoded.num_turns == 1


def test_tool_call_renders_as_dsml():
    text = render_chat(tool_chat())
    expected = (
        "Searching.\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="grep">\n'
        '<｜DSML｜parameter name="pattern" string="true">def main</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="max_hits" string="false">2</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + EOS
    )
    assert expected in text, text


def test_interrupted_reasoning_has_no_think_end_and_no_eos():
    messages = [
        Message("user", "Refactor the parser."),
        Message("assistant", reasoning="First I will split the lexer from", interrupted=True),
        Message("user", "Stop, keep the lexer."),
    ]
    text = render_chat(messages, thinking=True, keep_earlier_reasoning=True)
    assert f"{ASSISTANT}{THINK_START}First I will split the lexer from{USER}Stop, keep the lexer." in text, text


def test_spans_tile_the_ids_in_order():
    answer = Message("assistant", "In app.py and cli.py.", reasoning="Two hits.")
    messages = tool_chat() + [answer, Message("user", "Thanks")]
    encoded = encode_chat(messages, FallbackTokenizer())
    starts = [span.start for span in encoded.spans]
    ends = [span.end for span in encoded.spans]
    assert starts[0] == 0 and ends[-1] == len(encoded.ids)
    assert starts[1:] == ends[:-1], "spans must be contiguous and non-overlapping"
    assert all(span.start < span.end for span in encoded.spans), "every message occupies at least one token"
    assert [span.role for span in encoded.spans] == [
        "bos", "system", "user", "assistant", "tool", "tool", "assistant", "user", "generation_prompt",
    ]
    assert [turn.turn for turn in encoded.turn_spans] == [-1, 0, 1]
    assert encoded.token_turns() == [s.turn for s in encoded.spans for _ in range(s.start, s.end)]
    assert encoded.ids[encoded.spans[2].start] == SPECIAL_TOKEN_IDS[USER], "a user span starts at <｜User｜>"
    assert encoded.ids[encoded.spans[3].start] == SPECIAL_TOKEN_IDS[ASSISTANT]


def test_needle_span_decodes_back_to_needle_text():
    tokenizer = FallbackTokenizer()
    needle = "the deploy key is ZX-4471-QQ"
    messages = [
        Message("system", "You are a release bot."),
        Message("user", f"Remember: {needle}. Now build the image.", needles={"deploy_key": needle}),
        Message("assistant", "Built.", reasoning="Build it."),
        Message("user", "What was the deploy key?"),
    ]
    encoded = encode_chat(messages, tokenizer)
    span = encoded.needles["deploy_key"]
    assert (span.message_index, span.turn) == (1, 0)
    assert needle in tokenizer.decode(encoded.ids[span.start : span.end])
    assert needle in encoded.span_text(span.start, span.end)
    assert needle not in encoded.span_text(span.start + 1, span.end), "span must start at the needle's first token"
    assert needle not in encoded.span_text(span.start, span.end - 1), "span must end at the needle's last token"


def test_needle_missing_from_its_message_is_an_error():
    with pytest.raises(ValueError, match="'key'"):
        encode_chat([Message("user", "hello", needles={"key": "ZX-1"})], FallbackTokenizer())


def test_reasoning_on_a_user_message_is_rejected():
    with pytest.raises(ValueError, match="message 0 \\(user\\)"):
        render_chat([Message("user", "hi", reasoning="no")])


def test_fallback_ids_are_the_same_in_another_process():
    text = "def parse_header(self):\n        return 4471  # ZX-QQ <｜User｜>"
    script = f"from harness.scenario.tokenizer import FallbackTokenizer; print(FallbackTokenizer().encode({text!r}))"
    environment = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment, check=True)
    assert other.stdout.strip() == str(FallbackTokenizer().encode(text))


def test_fallback_ordinary_ids_avoid_the_special_range():
    tokenizer = FallbackTokenizer()
    ids = tokenizer.encode("Plain words, numbers 123456 and symbols {}[]<>.\n    indented_identifier_name")
    low, high = FallbackTokenizer.ORDINARY_ID_RANGE
    assert all(low <= token_id < high for token_id in ids), ids
    assert tokenizer.encode(BOS + EOS + THINK_START + THINK_END) == [0, 1, 128821, 128822]


# --- checkpoint tokenizer.json ------------------------------------------------------------------


def write_tokenizer_json(directory: Path, overrides: dict[str, int | None] | None = None) -> Path:
    """A tiny word-level tokenizer.json holding the spec's special tokens (ids changeable, None to omit)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    special_ids = {**SPECIAL_TOKEN_IDS, **(overrides or {})}
    specials = {token: token_id for token, token_id in special_ids.items() if token_id is not None}
    vocab = {**specials, "[UNK]": 2, "What": 10, "is": 11, "2": 12, "+": 13, "?": 14, "You": 15}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(list(specials))
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def test_hf_tokenizer_with_spec_ids_encodes_the_spec_example(tmp_path):
    tokenizer = load_tokenizer(write_tokenizer_json(tmp_path))
    assert isinstance(tokenizer, HFTokenizer)
    encoded = encode_chat(SPEC_MESSAGES, tokenizer)
    assert encoded.ids[0] == 0 and encoded.ids[-2:] == [128804, 128821]
    assert encoded.ids[encoded.spans[2].start] == 128803


def test_hf_tokenizer_wrong_special_id_names_token_and_file(tmp_path):
    write_tokenizer_json(tmp_path, {USER: 5})
    with pytest.raises(TokenizerSpecError) as error:
        HFTokenizer(tmp_path)
    message = str(error.value)
    assert "<｜User｜>" in message and "128803" in message and "5" in message, message
    assert str(tmp_path / "tokenizer.json") in message, message


def test_hf_tokenizer_missing_special_token_is_named(tmp_path):
    write_tokenizer_json(tmp_path, {THINK_START: None})
    with pytest.raises(TokenizerSpecError, match="'<think>' is missing"):
        HFTokenizer(tmp_path)


def test_load_tokenizer_falls_back_without_tokenizer_json(tmp_path):
    assert isinstance(load_tokenizer(None), FallbackTokenizer)
    with pytest.warns(UserWarning, match="no tokenizer.json"):
        assert isinstance(load_tokenizer(tmp_path), FallbackTokenizer)
