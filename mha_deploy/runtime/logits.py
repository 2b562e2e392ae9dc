"""Logits processors: one rule per class, applied in order to each step's scores. No torch.

The classes keep the names and the semantics of transformers' processors of the same name
(``transformers.generation.logits_process``), on numpy arrays: a user who moves from
``generate`` finds the same knobs doing the same thing, and each class is tested against its
namesake. Two rules that transformers lacks follow OpenAI's API instead, as vLLM serves it
(``PresenceFrequencyPenaltyLogitsProcessor``, ``LogitBiasLogitsProcessor``). A processor takes
the rows' token histories and the scores ``[rows, vocab]`` and returns new scores; it never
changes its input in place (the loop may still need it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from mha_deploy.errors import InputError, OptionError

# What a filtered token's score becomes: it can never be chosen, greedy or sampled.
FILTERED = -np.inf


@dataclass(frozen=True)
class TokenHistory:
    """The tokens each row has seen, for the rules that depend on them.

    ``tokens`` int64 [rows, length]: the prompt (left-padded; ``-1`` where a row has no token) then
    every token generated so far; ``generated``: how many tokens each row has generated (the same for
    every row of a batch, since rows start together and a finished row leaves)."""

    tokens: np.ndarray
    generated: int


class LogitsProcessor:
    """One rule over the scores of a step: ``processor(history, scores [rows, vocab]) -> scores``."""

    def __call__(self, history: TokenHistory, scores: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class LogitsProcessorList(list):
    """Processors applied in order, each to the previous one's scores."""

    def __call__(self, history: TokenHistory, scores: np.ndarray) -> np.ndarray:
        for processor in self:
            scores = processor(history, scores)
        return scores


class TemperatureLogitsWarper(LogitsProcessor):
    """Scores divided by ``temperature``: below 1 sharpens the distribution, above 1 flattens it."""

    def __init__(self, temperature: float):
        if not 0 < temperature < math.inf:
            raise OptionError(f"temperature must be a finite number > 0, got {temperature}; for greedy decoding, do "
                              "not sample")
        self.temperature = float(temperature)

    def __call__(self, history: TokenHistory, scores: np.ndarray) -> np.ndarray:
        return scores / np.float32(self.temperature)


class TopKLogitsWarper(LogitsProcessor):
    """Every token scored below the ``top_k``-th best of its row is filtered (ties with it are kept)."""

    def __init__(self, top_k: int, min_tokens_to_keep: int = 1):
        if not isinstance(top_k, int | np.integer) or top_k < 1:
            raise OptionError(f"top_k must be a positive integer, got {top_k!r}")
        self.top_k = max(int(top_k), min_tokens_to_keep)

    def __call__(self, history: TokenHistory, scores: np.ndarray) -> np.ndarray:
        k = min(self.top_k, scores.shape[-1])
        kth_best = -np.partition(-scores, k - 1, axis=-1)[:, k - 1 : k]
        return np.where(scores < kth_best, FILTERED, scores).astype(scores.dtype, copy=False)


class TopPLogitsWarper(LogitsProcessor):
    """Nucleus filtering: each row keeps its most probable tokens whose probabilities add up to ``top_p``,
    the token that crosses it included; at least ``min_tokens_to_keep`` stay."""

    def __init__(self, top_p: float, min_tokens_to_keep: int = 1):
        if not 0.0 <= top_p <= 1.0:
            raise OptionError(f"top_p must be in [0, 1], got {top_p}")
        if min_tokens_to_keep < 1:
            raise OptionError(f"min_tokens_to_keep must be at least 1, got {min_tokens_to_keep}")
        self.top_p = float(top_p)
        self.min_tokens_to_keep = min_tokens_to_keep

    def __call__(self, history: TokenHistory, scores: np.ndarray) -> np.ndarray:
        # Only the finite scores need sorting: a filtered token (top-k before this) has no mass and stays filtered.
        # Sorting a whole 32k vocabulary per row per step cost more than the rest of a sampled step.
        finite = np.isfinite(scores)
        width = min(max(int(finite.sum(axis=-1).max()), self.min_tokens_to_keep), scores.shape[-1])
        # Each row's finite scores first (a stable sort of booleans, linear; a partition of a row of equal -inf
        # values was slower than the full sort it was to avoid).
        top = np.argsort(~finite, axis=-1, kind="stable")[:, :width] if width < scores.shape[-1] else None
        subset = scores if top is None else np.take_along_axis(scores, top, axis=-1)
        # Ascending order, equal scores in vocabulary order: a token goes when the mass of the tokens up to it (it
        # included) stays within 1 - top_p, so the token that crosses the threshold, and every better one, stays.
        if top is None:
            # A whole vocabulary: numpy's default sort, twice as fast as a stable one; which of equal scores at the
            # cut goes is then numpy's choice, as it is torch.sort's in transformers.
            ids, order = np.broadcast_to(np.arange(scores.shape[-1]), scores.shape), np.argsort(subset, axis=-1)
        else:
            ids, order = top, np.lexsort((top, subset), axis=-1)
        ascending = np.take_along_axis(subset, order, axis=-1)
        cumulative = np.cumsum(_softmax(ascending), axis=-1)
        remove_sorted = cumulative <= (1.0 - self.top_p)
        remove_sorted[:, -self.min_tokens_to_keep :] = False
        keep = np.zeros(scores.shape, bool)
        kept_ids = np.take_along_axis(ids, order, axis=-1)
        rows = np.broadcast_to(np.arange(len(scores))[:, None], kept_ids.shape)
        keep[rows[~remove_sorted], kept_ids[~remove_sorted]] = True
        return np.where(keep, scores, FILTERED).astype(scores.dtype, copy=False)


class RepetitionPenaltyLogitsProcessor(LogitsProcessor):
    """Every token a row has already seen (prompt included, padding not) is made less likely: a positive
    score divided by ``penalty``, a negative one multiplied by it, once per token however often it came."""

    def __init__(self, penalty: float):
        if not 0 < penalty < math.inf:
            raise OptionError(f"repetition_penalty must be a finite number > 0 (1.0 is none), got {penalty}")
        self.penalty = float(penalty)

    def __call__(self, history: TokenHistory, scores: np.ndarray) -> np.ndarray:
        seen = np.zeros(scores.shape, bool)
        rows, positions = np.nonzero(history.tokens >= 0)
        tokens = history.tokens[rows, positions]
        inside = tokens < scores.shape[-1]  # an id the head cannot produce has no score to penalise
        seen[rows[inside], tokens[inside]] = True
        penalised = np.where(scores < 0, scores * np.float32(self.penalty), scores / np.float32(self.penalty))
        return np.where(seen, penalised, scores).astype(scores.dtype, copy=False)


# OpenAI's ranges: penalties in [-2, 2], a token's bias in [-100, 100] (enough to ban or force it).
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0


class PresenceFrequencyPenaltyLogitsProcessor(LogitsProcessor):
    """OpenAI's presence and frequency penalties: ``score[t] -= frequency_penalty * count_t + presence_penalty *
    (count_t > 0)``, where ``count_t`` is how often the row has *generated* ``t`` (its prompt does not count: OpenAI's
    and vLLM's docs define both over the text generated so far). Positive values make repeats less likely, negative
    ones more; each in [-2, 2]."""

    def __init__(self, presence_penalty: float = 0.0, frequency_penalty: float = 0.0):
        for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
            if (isinstance(value, bool) or not isinstance(value, int | float | np.floating)
                    or not -MAX_PENALTY <= value <= MAX_PENALTY):
                raise OptionError(f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 is none), "
                                  f"got {value!r}")
        self.presence_penalty = float(presence_penalty)
        self.frequency_penalty = float(frequency_penalty)

    def __call__(self, history: TokenHistory, scores: np.ndarray) -> np.ndarray:
        if history.generated == 0:
            return scores
        generated = history.tokens[:, -history.generated :]  # [rows, generated]: the completion so far
        vocab = scores.shape[-1]
        rows = np.broadcast_to(np.arange(len(generated))[:, None], generated.shape)
        inside = (generated >= 0) & (generated < vocab)
        # Only the tokens generated change: count them (row * vocab + id, sorted) instead of a dense [rows, vocab]
        # count, which cost more than the rest of a step on a 32k vocabulary.
        flat, counts = np.unique(rows[inside] * vocab + generated[inside], return_counts=True)
        penalty = np.float32(self.frequency_penalty) * counts.astype(np.float32) + np.float32(self.presence_penalty)
        penalised = scores.copy()
        penalised.reshape(-1)[flat] -= penalty.astype(scores.dtype, copy=False)
        return penalised


class LogitBiasLogitsProcessor(LogitsProcessor):
    """OpenAI's ``logit_bias``: ``{token id: bias}`` added to every row's scores, each bias in [-100, 100] (-100 bans
    a token in practice, +100 forces it). An id past the vocabulary is refused, naming it."""

    def __init__(self, logit_bias: Mapping[int, float]):
        if not isinstance(logit_bias, Mapping):
            raise OptionError(f"logit_bias must map token ids to biases, got {type(logit_bias).__name__}")
        for token, bias in logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int | np.integer) or token < 0:
                raise OptionError(f"logit_bias keys must be non-negative token ids, got {token!r}")
            if (isinstance(bias, bool) or not isinstance(bias, int | float | np.floating) or not math.isfinite(bias)
                    or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise OptionError(f"logit_bias of token {token} must be a number in [-{MAX_LOGIT_BIAS:g}, "
                                  f"{MAX_LOGIT_BIAS:g}], got {bias!r}")
        self.ids = np.array(list(logit_bias), np.int64)
        self.biases = np.array(list(logit_bias.values()), np.float32)

    def check_vocabulary(self, vocab: int) -> None:
        """Raise ``InputError`` naming the first id that a head of ``vocab`` scores cannot produce."""
        past = self.ids[self.ids >= vocab]
        if past.size:
            raise InputError(f"logit_bias names token id {int(past[0])}, past the model's vocabulary ({vocab} ids, "
                             f"0 to {vocab - 1})")

    def __call__(self, history: TokenHistory, scores: np.ndarray) -> np.ndarray:
        self.check_vocabulary(scores.shape[-1])
        biased = scores.copy()
        biased[:, self.ids] += self.biases
        return biased


class MinNewTokensLengthLogitsProcessor(LogitsProcessor):
    """The end ids are filtered until each row has generated ``min_new_tokens`` tokens."""

    def __init__(self, min_new_tokens: int, eos_token_id: int | Iterable[int]):
        if min_new_tokens < 0:
            raise OptionError(f"min_new_tokens must be >= 0, got {min_new_tokens}")
        self.min_new_tokens = int(min_new_tokens)
        self.eos_token_ids = token_ids(eos_token_id)

    def __call__(self, history: TokenHistory, scores: np.ndarray) -> np.ndarray:
        if history.generated >= self.min_new_tokens or not self.eos_token_ids:
            return scores
        scores = scores.copy()
        ids = [i for i in self.eos_token_ids if i < scores.shape[-1]]
        scores[:, ids] = FILTERED
        return scores


class ForcedBOSTokenLogitsProcessor(LogitsProcessor):
    """An encoder-decoder's first generated token forced (M2M100's and MBart-50's target language id): on a row
    whose history is its decoder start id alone, every score but ``token_id``'s is filtered and that one is 0, as
    transformers' processor of this name does; a row that began from a longer decoder prompt is left alone."""

    def __init__(self, token_id: int):
        (self.token_id,) = token_ids(token_id)

    def check_vocabulary(self, vocab: int) -> None:
        """Raise ``InputError`` when a head of ``vocab`` scores cannot produce the forced id (``check_token_id``)."""
        check_token_id(self.token_id, "forced_bos_token_id", vocab)

    def __call__(self, history: TokenHistory, scores: np.ndarray) -> np.ndarray:
        if history.tokens.shape[1] != 1:
            return scores
        self.check_vocabulary(scores.shape[-1])
        forced = np.full_like(scores, FILTERED)
        forced[:, self.token_id] = 0.0
        return forced


class SuppressTokensLogitsProcessor(LogitsProcessor):
    """Ids never generated (a Hugging Face generation config's ``suppress_tokens``: Whisper's non-speech symbols):
    filtered at every step, as transformers' processor of this name does; ids past the vocabulary are ignored."""

    def __init__(self, ids: Iterable[int]):
        self.ids = token_ids(ids)

    def __call__(self, history: TokenHistory, scores: np.ndarray) -> np.ndarray:
        ids = [i for i in self.ids if i < scores.shape[-1]]
        if not ids:
            return scores
        scores = scores.copy()
        scores[:, ids] = FILTERED
        return scores


class SuppressTokensAtBeginLogitsProcessor(SuppressTokensLogitsProcessor):
    """Ids never generated first (``begin_suppress_tokens``: Whisper's blank and end ids), as transformers applies
    them: at the first new token, or at the second where the first is forced (``forced_bos``) after the start id
    alone."""

    def __init__(self, ids: Iterable[int], forced_bos: bool = False):
        super().__init__(ids)
        self.forced_bos = forced_bos

    def __call__(self, history: TokenHistory, scores: np.ndarray) -> np.ndarray:
        prompt = history.tokens.shape[1] - history.generated
        begin = 1 if self.forced_bos and prompt == 1 else 0
        return super().__call__(history, scores) if history.generated == begin else scores


def token_ids(ids: int | Iterable[int] | None) -> tuple[int, ...]:
    """``ids`` as a tuple of distinct non-negative ints, in the order given (None: none)."""
    if ids is None:
        return ()
    values = [ids] if isinstance(ids, int | np.integer) else list(ids)
    for value in values:
        if not isinstance(value, int | np.integer) or value < 0:
            raise OptionError(f"token ids must be non-negative integers, got {value!r}")
    return tuple(dict.fromkeys(int(value) for value in values))


def check_token_id(token: object, name: str, vocab: int | None, hint: str = "") -> int:
    """``token`` as an int when it is an id of a vocabulary of ``vocab`` ids: an integer in [0, vocab) (vocab None:
    the size is not known, so any integer int64 holds, 0 or more); else ``InputError`` whose message names ``name``,
    the id and the vocabulary's size, then ``hint``. The one check of a token id that a caller gives (a served
    request's prompt, decoder prompt, stop ids, forced first id), so that every such refusal reads alike."""
    ids = f"0 to {vocab - 1}, the model's vocabulary of {vocab} ids" if vocab is not None else "0 or more, in int64"
    if isinstance(token, bool) or not isinstance(token, int | np.integer):
        raise InputError(f"{name}: token ids are integers ({ids}), got {token!r}{hint}")
    if token < 0:
        raise InputError(f"{name}: token id {token} is negative: token ids are {ids}{hint}")
    if vocab is not None and token >= vocab:
        raise InputError(f"{name}: token id {token} is past the model's vocabulary of {vocab} ids (0 to "
                         f"{vocab - 1}){hint}")
    if token > np.iinfo(np.int64).max:  # no vocabulary reaches it, and int64 would wrap it negative
        raise InputError(f"{name}: token id {token} is past int64, and past any vocabulary{hint}")
    return int(token)


def log_softmax(scores: np.ndarray) -> np.ndarray:
    """log(softmax(scores)) over the last axis, in float32, stable for large and -inf scores."""
    scores = scores.astype(np.float32, copy=False)
    peak = np.max(scores, axis=-1, keepdims=True)
    shifted = scores - np.where(np.isfinite(peak), peak, 0)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def _softmax(scores: np.ndarray) -> np.ndarray:
    return np.exp(log_softmax(scores))


def sampling_processors(
    temperature: float, top_k: int | None, top_p: float, min_tokens_to_keep: int = 1
) -> Sequence[LogitsProcessor]:
    """The warpers sampling adds after the rules every search applies, in transformers' order."""
    warpers: list[LogitsProcessor] = []
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k != 0:
        warpers.append(TopKLogitsWarper(top_k, min_tokens_to_keep))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p, min_tokens_to_keep))
    return warpers
