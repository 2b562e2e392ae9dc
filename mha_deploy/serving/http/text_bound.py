"""How many characters of text one token can stand for, read off a ``tokenizer.json``: so that a text prompt too long
to fit the model can be refused by its length alone, before it is tokenized.

A text of ``n`` characters yields at least ``n / chars_per_token`` tokens when every character of the text ends up
inside some token and no token covers more than ``chars_per_token`` characters. That holds when:

- the normalizer never shortens the text, or shortens it by a known factor: NFD, NFKD, lowercasing and prepending
  never shorten it; NFC and NFKC compose at most 4 characters into one (the longest canonical decomposition);
- the pre-tokenizer drops nothing (ByteLevel, Metaspace, Split that keeps its matches, Punctuation, Digits...);
  ``Whitespace`` and BERT's pre-tokenizer drop spaces, so 8 MB of spaces is no token at all;
- the model has no unknown token that covers a run of characters: BPE either without an unknown token (byte-level:
  every byte is in the vocabulary), with ``byte_fallback``, or without ``fuse_unk``; WordLevel and WordPiece map a
  whole unknown word to one token, Unigram fuses unknown characters;
- no added token strips the whitespace beside it (``lstrip``/``rstrip`` eat any run of spaces).

A vocabulary entry's length in characters bounds the text it covers: a byte-level entry's characters are bytes, and
a character is at least one byte; a continuing-subword prefix (``##``) or a byte-fallback piece (``<0xE2>``) only
makes the entry longer than what it covers. Anything this module does not know gives no bound (None): the prompt is
then tokenized whatever its length (off the event loop), since refusing it could refuse a prompt that fits.
"""

from __future__ import annotations

import json

# Normalizers that never shorten the text, and those that shorten it by at most this factor.
_LENGTHENING_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend"}
_COMPOSING_NORMALIZERS = {"NFC": 4, "NFKC": 4}
# Pre-tokenizers that keep every character (Split and Punctuation unless their behaviour is "Removed").
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def chars_per_token(tokenizer) -> int | None:
    """The most characters of a prompt's text one token of ``tokenizer`` (a ``tokenizers.Tokenizer``) can stand
    for, or None when no such bound holds (see the module's doc)."""
    spec = json.loads(tokenizer.to_str())
    if spec.get("truncation") is not None:  # the tokenizer cuts long texts itself: the count is not the text's
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    longest = _longest_entry(spec.get("model") or {})
    if shrink is None or longest is None or not _keeps_every_character(spec.get("pre_tokenizer")):
        return None
    for added in spec.get("added_tokens") or []:
        if added.get("lstrip") or added.get("rstrip"):
            return None
        longest = max(longest, len(added.get("content", "")))
    return shrink * max(longest, 1)


def _normalizer_shrink(normalizer: dict | None) -> int | None:
    """By how much at most the normalizer shortens a text (1: never), or None when unknown."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for step in normalizer.get("normalizers", []):
            step_factor = _normalizer_shrink(step)
            if step_factor is None:
                return None
            factor *= step_factor
        return factor
    if kind in _LENGTHENING_NORMALIZERS:
        return 1
    if kind == "Replace":  # a literal replaced by one at least as long (Llama's " " -> "▁"); a regex could be anything
        pattern, content = normalizer.get("pattern", {}), normalizer.get("content", "")
        literal = pattern.get("String")
        return 1 if literal is not None and len(content) >= len(literal) else None
    return _COMPOSING_NORMALIZERS.get(kind)


def _keeps_every_character(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_every_character(step) for step in pre_tokenizer.get("pretokenizers", []))
    return kind in _KEEPING_PRE_TOKENIZERS and pre_tokenizer.get("behavior") != "Removed"


def _longest_entry(model: dict) -> int | None:
    """The longest vocabulary entry of a model whose unknown token, if any, covers one character; else None."""
    if model.get("type") != "BPE":
        return None
    if model.get("unk_token") is not None and model.get("fuse_unk") and not model.get("byte_fallback"):
        return None
    vocab = model.get("vocab") or {}
    return max(map(len, vocab), default=1)
