"""Tokenizers for scenario prompts: the checkpoint's own, or a deterministic stand-in.

A real checkpoint ships `tokenizer.json`; its ids are what the model was trained on, so a run on a
real checkpoint must use it. Synthetic weights have no tokenizer, but the harness still needs ids
that look like DeepSeek-V4's: the special tokens at their real ids (hash layers 0-2 route by token
id, spec §6.1, and the chat markers are what turn spans are cut at) and ordinary text spread over
the ordinary part of the 129,280-entry vocabulary. `FallbackTokenizer` provides exactly that,
identically on every machine and in every process.
"""

from __future__ import annotations

import hashlib
import re
import warnings
from pathlib import Path
from typing import Protocol, Sequence

VOCAB_SIZE = 129_280  # spec §1.1 vocab_size (embedding rows, padded beyond the tokenizer's entries)

# Spec §9. The bars are FULLWIDTH VERTICAL LINE U+FF5C and the space marker is U+2581.
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
LATEST_REMINDER = "<｜latest_reminder｜>"

SPECIAL_TOKEN_IDS: dict[str, int] = {
    BOS: 0,
    EOS: 1,
    USER: 128803,
    ASSISTANT: 128804,
    THINK_START: 128821,
    THINK_END: 128822,
    DSML: 128825,
    LATEST_REMINDER: 128828,
}

Offsets = list[tuple[int, int]]


class Tokenizer(Protocol):
    """What the harness needs from a tokenizer.

    `encode_with_offsets` returns each token's [start, end) character range in `text`; the chat
    encoder uses it to tell which tokens belong to which message and needle without re-tokenizing
    pieces separately (which would change BPE merges at the seams).
    """

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def encode_with_offsets(self, text: str) -> tuple[list[int], Offsets]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def special_token_id(self, token: str) -> int: ...


class TokenizerSpecError(ValueError):
    """A tokenizer file disagrees with the special-token ids of spec §9."""


class HFTokenizer:
    """The checkpoint's `tokenizer.json`, checked against spec §9 when loaded.

    A wrong special id would silently shift every turn boundary and feed the hash-routed layers
    different experts, so a disagreement is an error, not a warning.
    """

    def __init__(self, checkpoint_dir: Path):
        from tokenizers import Tokenizer as _RustTokenizer  # optional dependency: only real checkpoints need it

        self.path = Path(checkpoint_dir) / "tokenizer.json"
        self._tokenizer = _RustTokenizer.from_file(str(self.path))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self._check_special_tokens()

    def _check_special_tokens(self) -> None:
        for token, expected_id in SPECIAL_TOKEN_IDS.items():
            found_id = self._tokenizer.token_to_id(token)
            if found_id is None:
                raise TokenizerSpecError(f"{self.path}: special token {token!r} is missing (spec §9 id {expected_id})")
            if found_id != expected_id:
                raise TokenizerSpecError(
                    f"{self.path}: special token {token!r} has id {found_id}, spec §9 says {expected_id}"
                )
            as_text = self._tokenizer.encode(token, add_special_tokens=False).ids
            if as_text != [expected_id]:
                raise TokenizerSpecError(
                    f"{self.path}: special token {token!r} encodes to {as_text}, expected the single id "
                    f"{expected_id}; it is not registered as an added/special token"
                )

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], Offsets]:
        # add_special_tokens=False: BOS is part of the rendered text, a post-processor must not add another.
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return list(encoding.ids), [tuple(offset) for offset in encoding.offsets]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def special_token_id(self, token: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise KeyError(f"{self.path}: no token {token!r}")
        return token_id


class FallbackTokenizer:
    """Deterministic tokenizer for synthetic weights: no files, same ids everywhere.

    Special strings are matched whole first and get their real ids. The rest is cut into
    GPT-style pieces (a word with its leading space, up to 3 digits, up to 3 punctuation marks, a
    newline with the indentation after it); letter runs longer than 8 are cut into 5-letter pieces
    so code and prose land near 4 characters per token like the real tokenizer. Each piece's id
    is a blake2b hash of its UTF-8 bytes into the ordinary range, so it never depends on Python's
    randomized `hash()`, on the process or on what was encoded before. Hashing cannot be inverted,
    so `decode` renders the pieces this instance has encoded (others as `<id>`); two pieces that
    share an id (about 1 in 150 distinct pieces of a 30K-token session) decode as whichever came
    first. For exact text under tokens use the offsets (`EncodedChat.span_text`).
    """

    ORDINARY_ID_RANGE = (1_000, 128_000)  # below the special block (128,000+), away from BOS/EOS
    _LONG_WORD = 8
    _WORD_PIECE = 5
    _MAX_WHITESPACE = 16

    # A space run leaves its last space to the word after it, as GPT-style pre-tokenizers do.
    _PIECE = re.compile(r" ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]{1,3}|\n+[ \t]*|[ \t]+(?!\S)|[ \t]+|\s")

    def __init__(self) -> None:
        self.vocab_size = VOCAB_SIZE
        specials = sorted(SPECIAL_TOKEN_IDS, key=len, reverse=True)  # longest first: no prefix wins early
        self._special = re.compile("|".join(re.escape(token) for token in specials))
        self._piece_ids: dict[str, int] = {}
        self._id_pieces: dict[int, str] = {token_id: token for token, token_id in SPECIAL_TOKEN_IDS.items()}

    def _piece_id(self, piece: str) -> int:
        token_id = self._piece_ids.get(piece)
        if token_id is None:
            digest = hashlib.blake2b(piece.encode("utf-8"), digest_size=8).digest()
            low, high = self.ORDINARY_ID_RANGE
            token_id = low + int.from_bytes(digest, "little") % (high - low)
            self._piece_ids[piece] = token_id
            self._id_pieces.setdefault(token_id, piece)
        return token_id

    def _pieces(self, text: str, start: int, end: int):
        """Yield the (start, end) character range of each ordinary piece of text[start:end]."""
        for match in self._PIECE.finditer(text, start, end):
            piece_start, piece_end = match.span()
            piece = match.group()
            if piece[-1].isalpha() and len(piece.lstrip(" ")) > self._LONG_WORD:
                first_cut = piece_start + (piece[0] == " ") + self._WORD_PIECE  # the leading space rides along
                cuts = [piece_start, *range(first_cut, piece_end, self._WORD_PIECE), piece_end]
            elif piece[0].isspace() and len(piece) > self._MAX_WHITESPACE:
                cuts = [*range(piece_start, piece_end, self._MAX_WHITESPACE), piece_end]
            else:
                cuts = [piece_start, piece_end]
            yield from zip(cuts, cuts[1:])

    def encode_with_offsets(self, text: str) -> tuple[list[int], Offsets]:
        ids: list[int] = []
        offsets: Offsets = []
        position = 0
        for special in self._special.finditer(text):
            for span in self._pieces(text, position, special.start()):
                ids.append(self._piece_id(text[span[0] : span[1]]))
                offsets.append(span)
            ids.append(SPECIAL_TOKEN_IDS[special.group()])
            offsets.append(special.span())
            position = special.end()
        for span in self._pieces(text, position, len(text)):
            ids.append(self._piece_id(text[span[0] : span[1]]))
            offsets.append(span)
        return ids, offsets

    def encode(self, text: str) -> list[int]:
        return self.encode_with_offsets(text)[0]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self._id_pieces.get(token_id, f"<{token_id}>") for token_id in ids)

    def special_token_id(self, token: str) -> int:
        if token not in SPECIAL_TOKEN_IDS:
            raise KeyError(f"fallback tokenizer: no special token {token!r}")
        return SPECIAL_TOKEN_IDS[token]


def load_tokenizer(checkpoint_dir: Path | None) -> Tokenizer:
    """The checkpoint's tokenizer.json when there is one, else the deterministic fallback."""
    if checkpoint_dir is not None:
        if (Path(checkpoint_dir) / "tokenizer.json").is_file():
            return HFTokenizer(Path(checkpoint_dir))
        warnings.warn(
            f"{checkpoint_dir} has no tokenizer.json; using the built-in fallback tokenizer, whose ids "
            "are not the real model's",
            stacklevel=2,
        )
    return FallbackTokenizer()
