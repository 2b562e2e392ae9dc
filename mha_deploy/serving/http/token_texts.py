"""Tokens as the logprobs fields show them, and where each one's text starts in the answer's text.

OpenAI shows a token as the text it decodes to (" sat", not the byte-level piece "Ġsat"), and a token holding only
part of a character's UTF-8 bytes as those bytes, ``bytes:\\xe2\\x80``; ``text_offset`` is where the token's text
starts in the choice's text, counted in characters.

- A byte-level tokenizer (GPT-2's ByteLevel decoder): each token's bytes are read off its piece through the byte
  table, so a token shows exactly, and a ``TextCursor`` feeds them to an incremental UTF-8 decoder that counts the
  characters the text has before each token (a token that starts inside a character points at that character). The
  decoder replaces invalid bytes as ``tokenizers`` does (one U+FFFD per maximal invalid subpart), so the count is
  the answer's own; a token after bytes that form no character starts after their U+FFFD.
- Any other tokenizer decodes whole characters: a token shows as it decodes alone, and its offset is where the
  text decoded up to it ends, less its own length (a decoder that joins words with spaces puts them between).
- No tokenizer: a token shows as its id, offsets count those digits.
"""

from __future__ import annotations

import codecs
import json


def _byte_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the others for the
    characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + extra)] = byte
            extra += 1
    return table


BYTE_TABLE = _byte_table()


def bytes_label(data: bytes) -> str:
    """OpenAI's name for bytes that are no whole characters: ``bytes:`` then printable ASCII as is, others ``\\xNN``."""
    return "bytes:" + "".join(chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}" for b in data)


class TokenTexts:
    """How the tokens of one tokenizer (a ``tokenizers.Tokenizer``, or None) show in logprobs."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.byte_level = False
        self.skipped: set[int] = set()  # special tokens: decoding skips them, so they add nothing to the text
        if tokenizer is not None:
            decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
            self.byte_level = decoder.get("type") == "ByteLevel"
            self.skipped = {i for i, added in tokenizer.get_added_tokens_decoder().items() if added.special}

    def token_bytes(self, token: int) -> bytes:
        """The UTF-8 bytes ``token`` adds to the text (a special token: its piece's)."""
        piece = self.tokenizer.id_to_token(int(token)) if self.tokenizer is not None else None
        if piece is None:
            return str(token).encode()
        if self.byte_level and int(token) not in self.skipped:
            # As tokenizers' ByteLevel decoder: a piece all in the byte alphabet is those bytes, another its text.
            if all(c in BYTE_TABLE for c in piece):
                return bytes(BYTE_TABLE[c] for c in piece)
            return piece.encode()
        return self.show(token).encode()

    def show(self, token: int) -> str:
        """``token`` as the logprobs fields name it (see the module's doc)."""
        if self.tokenizer is None:
            return str(token)
        if self.byte_level:
            data = self.token_bytes(token)
            try:
                return data.decode("utf-8")
            except UnicodeDecodeError:
                return bytes_label(data)
        decoded = self.tokenizer.decode([int(token)], skip_special_tokens=True)
        return decoded or self.tokenizer.id_to_token(int(token)) or str(token)

    def cursor(self, start: int = 0) -> TextCursor:
        """Offsets of one sequence's tokens, from ``start`` characters into the choice's text."""
        return TextCursor(self, start)


class TextCursor:
    """Walks one sequence's tokens in order: ``offset(token)`` is where that token's text starts."""

    def __init__(self, texts: TokenTexts, start: int):
        self.texts = texts
        self.start = start
        self.position = start  # characters of text before the next token
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._tokens: list[int] = []  # the tokens so far, for a tokenizer decoded whole

    def offset(self, token: int) -> int:
        texts = self.texts
        if texts.tokenizer is None:
            at = self.position
            self.position += len(str(token))
            return at
        if texts.byte_level:
            at = self.position
            if int(token) not in texts.skipped:
                data = texts.token_bytes(token)
                pending = self._utf8.getstate()[0]
                if pending and data and not _continues(pending, data[:1]):
                    at += 1  # the bytes left pending are no character: one U+FFFD stands before this token's text
                self.position += len(self._utf8.decode(data))
            return at
        self._tokens.append(int(token))
        end = self.start + len(texts.tokenizer.decode(self._tokens, skip_special_tokens=True))
        at = min(max(self.position, end - len(texts.show(token))), end)
        self.position = end
        return at


def _continues(pending: bytes, following: bytes) -> bool:
    """Whether ``following`` continues the start of a character ``pending`` holds (strict UTF-8)."""
    try:
        codecs.getincrementaldecoder("utf-8")("strict").decode(pending + following)
    except UnicodeDecodeError:
        return False
    return True
