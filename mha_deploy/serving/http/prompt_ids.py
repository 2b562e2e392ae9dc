"""Text or token ids in, as OpenAI's routes take them: completions' ``prompt`` and embeddings' ``input`` (a string, a
list of strings, a list of token ids, or a list of such lists), each as an int64 array of ids.

Both are bounded before the work: a text too long to fit is refused by its length alone, before it is tokenized
(``text_bound``), a list of ids longer than the model takes before it is converted; a long text or list is tokenized
or converted in a thread, so that one large request cannot hold every other request and health check meanwhile.
Ids are only converted here: their range is the model's to check (a generator's vocabulary, the encoder's validator).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import numpy as np

from mha_deploy.errors import InputError
from mha_deploy.runtime.logits import check_token_id
from mha_deploy.serving.http.parsing import FieldError, RequestError

# Texts up to this long are tokenized, and id lists converted, on the event loop (well under a millisecond); longer
# ones in a thread.
INLINE_TEXT_CHARS = 16_384
INLINE_IDS = 16_384
SHAPES = "a string, a list of strings, a list of token ids or a list of such lists"


async def text_ids(text: str, param: str, tokenizer, longest: int | None, chars_per_token: int | None) -> np.ndarray:
    """The ids of ``text`` under ``tokenizer`` (a ``PromptTokenizer``, or None: refused, ids only), refused by its
    length when it cannot fit ``longest`` tokens (None: no bound) with ``chars_per_token`` characters per token at
    most (None: no such bound; it is then tokenized whatever its length)."""
    if tokenizer is None:
        raise RequestError(400, "no_tokenizer",
                           f"{param}: text needs a tokenizer (start the server with --tokenizer tokenizer.json); "
                           "or send token ids")
    if longest is not None and chars_per_token is not None and len(text) > longest * chars_per_token:
        raise RequestError(400, "context_length_exceeded",
                           f"{param}: the text's {len(text)} characters are more tokens than this model's maximum "
                           f"length of {longest} (a token of this tokenizer stands for at most "
                           f"{chars_per_token} characters); shorten it")
    if len(text) <= INLINE_TEXT_CHARS:
        return _tokenize(tokenizer, text, param)
    return await asyncio.to_thread(_tokenize, tokenizer, text, param)


def _tokenize(tokenizer, text: str, param: str) -> np.ndarray:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON's "\ud800" escape: half a UTF-16 pair, no character
        raise RequestError(400, "bad_text",
                           f"{param}: holds a lone surrogate {text[exc.start]!r} at character {exc.start}, "
                           "which is not text (a \\uD800-\\uDFFF escape must be half of a pair)") from None
    return tokenizer.encode(text)


def token_id(token: object, param: str, vocab: int | None, hint: str = "") -> int:
    """``token`` as an int when a vocabulary of ``vocab`` ids holds it (None: not known), else a 400 naming ``param``
    in ``logits.check_token_id``'s words (the field, the id, the vocabulary's size): every generation route's check of
    an id a request gives."""
    try:
        return check_token_id(token, param, vocab, hint)
    except InputError as exc:
        raise FieldError(400, "bad_token_id", str(exc), param) from None


async def list_ids(items: object, param: str, longest: int | None,
                   bad_id: Callable[[int, str], None]) -> np.ndarray:
    """Token ids given as a JSON list of integers, as int64; a list longer than ``longest`` is refused before it is
    converted, an id past int64 (which no vocabulary reaches) by ``bad_id(id, param)``, which raises."""
    if not isinstance(items, list):
        raise RequestError(400, "bad_prompt", f"{param}: must be a list of token ids")
    if longest is not None and len(items) > longest:
        raise RequestError(400, "context_length_exceeded",
                           f"{param}: {len(items)} tokens exceed this model's maximum length {longest}; shorten "
                           "it")
    if len(items) <= INLINE_IDS:
        return _id_array(items, param, bad_id)
    return await asyncio.to_thread(_id_array, items, param, bad_id)


def _id_array(items: list, param: str, bad_id: Callable[[int, str], None]) -> np.ndarray:
    if not all(type(i) is int for i in items):  # bool is an int subclass: true is no token id
        raise RequestError(400, "bad_prompt", f"{param}: must be a list of token ids (integers)")
    try:
        return np.asarray(items, np.int64)
    except OverflowError:
        bad_id(next(i for i in items if not -(2**63) <= i < 2**63), param)
        raise  # bad_id refuses every id beyond int64


def is_id_list(value: object) -> bool:
    """Whether ``value`` is one list of token ids (not a list of texts or of id lists)."""
    return isinstance(value, list) and bool(value) and type(value[0]) is int


async def prompt_list(
    value: object,
    param: str,
    encode: Callable[[str, str], Awaitable[np.ndarray]],
    ids: Callable[[list, str], Awaitable[np.ndarray]],
) -> list[tuple[np.ndarray, str | None]]:
    """``value`` in any of OpenAI's four shapes, each entry as (ids, its text as given; None for ids). ``encode`` and
    ``ids`` turn one text or id list into ids, given the field's name as the client sees it (``input[2]``). Refusals
    are ``RequestError``s whose message starts with that name; an empty or missing value is refused."""
    async def one(item, where: str) -> tuple[np.ndarray, str | None]:
        if isinstance(item, str):
            return await encode(item, where), item
        if isinstance(item, list) and not (item and isinstance(item[0], str | list)):
            return await ids(item, where), None
        raise RequestError(400, "invalid_value", f"{param}: must be {SHAPES}")

    if isinstance(value, str) or is_id_list(value):
        return [await one(value, param)]
    if isinstance(value, list) and value:
        return [await one(item, f"{param}[{i}]") for i, item in enumerate(value)]
    raise RequestError(400, "invalid_value", f"{param}: is required: {SHAPES}")
