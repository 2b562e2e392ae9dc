"""Generating tokens from a causal LM without torch: greedy, sampling and beam search over a ``TokenStepper``.

The search never sees the model: it asks a ``TokenStepper`` for the logits of the next token
(``prefill`` for the prompts, ``step`` for each chosen token), turns them into tokens through the
logits processors (``mha_deploy.runtime.logits``, one rule each, in order) and the stopping
criteria (``mha_deploy.runtime.stopping``), and tells the stepper which cache rows live on
(``keep``): a finished row leaves and its cache is freed; beam search reorders and repeats rows
(``mha_deploy.runtime.beam_search`` decides which). ``KVCacheStepper``
(``mha_deploy.runtime.kv_stepper``) is the stepper over an ONNX decoder with a KV cache.

Semantics follow transformers' ``generate`` so that its users find what they expect and the tests
can hold the loop to it: greedy unless told to sample, the end id kept in the output, the rules
applied in transformers' order (repetition penalty, minimum new tokens, then temperature, top-k,
top-p when sampling), and beam search scored and stopped as there (see ``beam_search``). OpenAI's
``logit_bias`` comes before the repetition penalty and its ``presence_penalty`` and
``frequency_penalty`` after it, as vLLM applies them; greedy and sampling take them, beam search
refuses them (see ``GenerationConfig``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import numpy as np

from mha_deploy.errors import InputError, OptionError
from mha_deploy.metadata import POSITIONS_PADDED_WIDTH
from mha_deploy.runtime.beam_search import BeamSearchScorer, check_length_penalty
from mha_deploy.runtime.logits import (
    ForcedBOSTokenLogitsProcessor,
    LogitBiasLogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    PresenceFrequencyPenaltyLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TokenHistory,
    log_softmax,
    sampling_processors,
    token_ids,
)
from mha_deploy.runtime.stopping import EosTokenCriteria, MaxNewTokensCriteria, StoppingCriteriaList
from mha_deploy.seeds import SEED_LIMIT

# The options given as real numbers: each must be finite, whether or not the search uses it.
FLOAT_OPTIONS = ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                 "length_penalty")


@runtime_checkable
class TokenStepper(Protocol):
    """What the search drives: a model that holds its own cache, one row per running sequence.

    - ``prefill(input_ids, attention_mask)``: start a batch from prompts int64 [rows, seq]
      (``attention_mask`` int64 [rows, seq], 1 = real token, 0 = padding); returns the logits of
      each row's next token [rows, vocab]. An encoder-decoder reads them as the encoder's input and
      starts its decoder from ``decoder_start_token_id``, or from ``decoder_input_ids=`` [rows, length]
      where ``generate`` was given decoder prompts (asked only then).
    - ``step(next_ids)``: append one token per row (int64 [rows]); returns [rows, vocab], which the stepper may
      overwrite on its next call (the search reads them before it calls again).
    - ``keep(rows)``: the current rows that the next call continues, in their new order (int64 indices
      into the current rows; an index may repeat, a row left out is freed).
    - ``decoder_start_token_id``: None for a decoder-only model; an encoder-decoder's decoder start id,
      which is then the first token of every row's history (what the repetition penalty sees).
    """

    decoder_start_token_id: int | None

    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray: ...

    def step(self, next_ids: np.ndarray) -> np.ndarray: ...

    def keep(self, rows: np.ndarray) -> None: ...


@dataclass(frozen=True)
class GenerationConfig:
    """How to choose tokens. Greedy by default; ``do_sample`` samples, ``num_beams > 1`` searches beams.

    - ``max_new_tokens``: a row ends after this many tokens; ``min_new_tokens``: no end id before this many.
    - ``eos_token_id``: an id or ids that end a row (kept in its output); ``stop_token_ids``: more of them.
      None: the ids the stepper's file recorded at export (``export --eos-id``), if any; ``[]``: none. Without
      any, every row runs to ``max_new_tokens``.
    - sampling: ``temperature``, ``top_k`` (None: off; transformers' generate uses 50 unless told), ``top_p``,
      ``seed`` (numpy's default generator, an integer in [0, 2**64); None: fresh entropy).
    - ``repetition_penalty``: every search; 1.0 is none.
    - OpenAI's ``presence_penalty`` and ``frequency_penalty`` (each in [-2, 2], 0 is none: a token's score loses
      ``frequency_penalty`` per time the row generated it and ``presence_penalty`` once it has, the prompt not
      counted) and ``logit_bias`` ({token id: bias in [-100, 100]} added to the scores): greedy and sampling only.
      Beam search refuses them: it ranks hypotheses by summed log-probabilities, and a bias or penalty there would
      be added to log-probabilities already normalised, changing the hypotheses' scores rather than the
      distribution of their next token as OpenAI defines it.
    - beams: ``num_beams``, ``length_penalty`` (hypotheses scored sum of log-probs / length ** it; finite, and
      bounded so that length ** it stays finite up to ``max_new_tokens``: ``beam_search.length_penalty_bound``),
      ``early_stopping`` (False, as transformers; True or "never").
    - every real-valued option must be finite (an infinite temperature or penalty would turn scores into NaN or
      filter every token), even one the search does not use.
    - ``pad_token_id``: what ``GenerationOutput.padded`` fills with (default: the file's recorded pad id, else the
      first end id, else 0).
    - ``forced_bos_token_id`` (an encoder-decoder's): the first generated token of a row that starts from its
      decoder start id alone (M2M100's and MBart-50's target language), as transformers forces it; None: the id the
      file recorded at export (the folder's generation config), if any. A row given a decoder prompt is not forced.
    - ``suppress_tokens`` (never generated) and ``begin_suppress_tokens`` (never generated first; second where the
      first is forced): a Hugging Face generation config's (Whisper's), applied as transformers applies them; None:
      the ids the file recorded at export, if any; ``[]``: none.
    """

    max_new_tokens: int = 20
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    eos_token_id: int | Sequence[int] | None = None
    stop_token_ids: Sequence[int] = ()
    pad_token_id: int | None = None
    seed: int | None = None
    forced_bos_token_id: int | None = None
    suppress_tokens: Sequence[int] | None = None
    begin_suppress_tokens: Sequence[int] | None = None

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise OptionError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not isinstance(self.min_new_tokens, int) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise OptionError(
                f"min_new_tokens must be an integer in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens!r}"
            )
        if not isinstance(self.num_beams, int) or self.num_beams < 1:
            raise OptionError(f"num_beams must be a positive integer, got {self.num_beams!r}")
        if self.num_beams > 1 and self.do_sample:
            raise OptionError("beam search samples nothing here: give num_beams > 1 or do_sample, not both")
        if self.num_beams > 1 and (self.presence_penalty or self.frequency_penalty or self.logit_bias):
            raise OptionError("presence_penalty, frequency_penalty and logit_bias apply to greedy and sampled "
                              "generation only, not to beam search (num_beams > 1): beam search ranks summed "
                              "log-probabilities, where they would not mean what OpenAI defines")
        if self.early_stopping not in (True, False, "never"):
            raise OptionError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        for name in ("pad_token_id", "forced_bos_token_id"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise OptionError(f"{name} must be a non-negative integer, got {value!r}")
        for name in FLOAT_OPTIONS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float | np.floating) or not math.isfinite(value):
                raise OptionError(f"{name} must be a finite number, got {value!r}")
        if not 0.0 <= self.top_p <= 1.0:
            raise OptionError(f"top_p must be in [0, 1] (1.0 is off), got {self.top_p}")
        check_length_penalty(self.length_penalty, self.max_new_tokens)
        if self.seed is not None and (not isinstance(self.seed, int | np.integer) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < SEED_LIMIT):
            raise OptionError(f"seed must be an integer in [0, 2**64 - 1] (an unsigned 64-bit integer), "
                              f"got {self.seed!r}")
        # Built once here so that a bad temperature, top_k, top_p or penalty is refused before any model call.
        self.logits_processors()

    def check_vocabulary(self, vocab: int | None) -> None:
        """``OptionError`` naming the first end id past a vocabulary of ``vocab`` ids (None: not known, nothing to
        check): the model can never produce it, so it would end no row, silently."""
        if vocab is None:
            return
        for name, ids in (("eos_token_id", self.eos_token_id), ("stop_token_ids", self.stop_token_ids),
                          ("forced_bos_token_id", self.forced_bos_token_id)):
            past = [token for token in token_ids(ids) if token >= vocab]
            if past:
                raise OptionError(f"{name} {past[0]} is past the model's vocabulary of {vocab} ids (0 to {vocab - 1}), "
                                  "so the model could never produce it: was it taken from another model's tokenizer?")

    @property
    def end_ids(self) -> tuple[int, ...]:
        """Every id that ends a row: ``eos_token_id`` then ``stop_token_ids``."""
        return token_ids([*token_ids(self.eos_token_id), *token_ids(self.stop_token_ids)])

    def logits_processors(self) -> LogitsProcessorList:
        """The rules this config applies, in transformers' order (OpenAI's as vLLM orders them, see the module)."""
        processors = LogitsProcessorList()
        if self.logit_bias:
            processors.append(LogitBiasLogitsProcessor(self.logit_bias))
        if self.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(self.repetition_penalty))
        if self.presence_penalty or self.frequency_penalty:
            processors.append(PresenceFrequencyPenaltyLogitsProcessor(self.presence_penalty, self.frequency_penalty))
        if self.min_new_tokens > 0 and self.end_ids:
            processors.append(MinNewTokensLengthLogitsProcessor(self.min_new_tokens, self.end_ids))
        if self.forced_bos_token_id is not None:
            processors.append(ForcedBOSTokenLogitsProcessor(self.forced_bos_token_id))
        if self.suppress_tokens:
            processors.append(SuppressTokensLogitsProcessor(self.suppress_tokens))
        if self.begin_suppress_tokens:
            processors.append(SuppressTokensAtBeginLogitsProcessor(self.begin_suppress_tokens,
                                                                   self.forced_bos_token_id is not None))
        if self.do_sample:
            processors.extend(sampling_processors(self.temperature, self.top_k, self.top_p))
        return processors

    def stopping_criteria(self) -> StoppingCriteriaList:
        criteria = StoppingCriteriaList([MaxNewTokensCriteria(self.max_new_tokens)])
        if self.end_ids:
            criteria.append(EosTokenCriteria(self.end_ids))
        return criteria


@dataclass(frozen=True)
class StepTokens:
    """One step of a streamed generation: ``tokens[i]`` is the new token of prompt ``prompts[i]``;
    ``finished[i]`` says that it was that prompt's last (an end id, or ``max_new_tokens`` reached)."""

    prompts: np.ndarray
    tokens: np.ndarray
    finished: np.ndarray


@dataclass(frozen=True)
class GenerationOutput:
    """Per prompt, in the order given: ``tokens[i]`` int64, the new tokens only (an end id that ended it
    included); ``scores[i]``, beam search's score of the hypothesis returned (None for other searches)."""

    tokens: list[np.ndarray]
    pad_token_id: int
    scores: list[float] | None = field(default=None)

    def padded(self, width: int | None = None) -> np.ndarray:
        """The tokens as one int64 [prompts, width] array, filled on the right with ``pad_token_id``
        (as transformers' ``generate`` returns finished rows); width defaults to the longest."""
        width = max((len(t) for t in self.tokens), default=0) if width is None else width
        out = np.full((len(self.tokens), width), self.pad_token_id, np.int64)
        for row, tokens in enumerate(self.tokens):
            out[row, : len(tokens)] = tokens[:width]
        return out


def generate(
    stepper: TokenStepper,
    input_ids,
    attention_mask=None,
    config: GenerationConfig | None = None,
    decoder_prompts: Sequence | None = None,
    **options,
) -> GenerationOutput:
    """Generate for every prompt: ``input_ids`` int [batch, seq] (with ``attention_mask`` [batch, seq], 1 = real,
    padding on either side; transformers' models expect it on the left) or a list of prompts of any lengths
    (padded on the left here). ``options`` override ``config``'s fields (``max_new_tokens=32, num_beams=4``).

    ``decoder_prompts`` (an encoder-decoder's): per prompt, the token ids its decoder starts from (Whisper's
    ``<|startoftranscript|><|lang|><|task|><|notimestamps|>``), or None for the decoder start id alone; a prompt
    that does not begin with the start id gets it in front, as transformers' ``decoder_input_ids`` do. The prompt's
    tokens are not returned: the new tokens follow it. Rows of one decoder prompt length run together.

    An encoder-decoder whose encoder takes features (Whisper: ``stepper.source_features``) takes them as
    ``input_ids``: float [batch, <the sizes its encoder takes>], no mask (the stepper checks them)."""
    config = _config(config, options, stepper)
    ids, mask = prompt_batch(input_ids, attention_mask, getattr(stepper, "source_features", None) is not None)
    if decoder_prompts is None:
        return _generate(stepper, ids, mask, config)
    prompts = decoder_prompt_rows(stepper, decoder_prompts, len(ids))
    lengths = np.array([len(prompt) for prompt in prompts])
    tokens: list[np.ndarray] = [np.zeros(0, np.int64)] * len(ids)
    scores: list[float] | None = [0.0] * len(ids) if config.num_beams > 1 else None
    for length in sorted(set(lengths.tolist())):
        rows = np.flatnonzero(lengths == length)
        part = _generate(stepper, ids[rows], mask[rows], config, np.stack([prompts[row] for row in rows]))
        for index, row in enumerate(rows):
            tokens[row] = part.tokens[index]
            if scores is not None:
                scores[row] = part.scores[index]
    return GenerationOutput(tokens, _pad_id(config), scores)


def decoder_prompt_rows(stepper: TokenStepper, decoder_prompts: Sequence, rows: int) -> list[np.ndarray]:
    """Each row's decoder prompt as int64 ids beginning with the decoder start id (put in front where it is not
    there; None or empty: the start id alone); ``InputError`` for a decoder-only model, a count other than the
    prompts', or ids that are not non-negative integers below the model's vocabulary."""
    start = getattr(stepper, "decoder_start_token_id", None)
    if start is None:
        raise InputError("decoder prompts are an encoder-decoder's: this model's decoder starts from the prompt itself")
    if len(decoder_prompts) != rows:
        raise InputError(f"{len(decoder_prompts)} decoder prompts for {rows} prompts: give one per prompt (None for "
                         "the start id alone)")
    vocab = vocab_size(stepper)
    out = []
    for row, prompt in enumerate(decoder_prompts):
        ids = np.zeros(0, np.int64) if prompt is None else np.asarray(prompt).ravel()
        if ids.size and (ids.dtype.kind not in "iu" or ids.min() < 0):
            raise InputError(f"decoder prompt {row} must hold non-negative integer token ids, got {ids.tolist()}")
        if vocab is not None and ids.size and ids.max() >= vocab:
            raise InputError(f"decoder prompt {row}: token id {int(ids.max())} is past the model's vocabulary of "
                             f"{vocab} ids")
        ids = ids.astype(np.int64)
        out.append(ids if ids.size and ids[0] == start else np.concatenate([[start], ids]).astype(np.int64))
    return out


def _generate(
    stepper: TokenStepper, ids: np.ndarray, mask: np.ndarray, config: GenerationConfig,
    decoder_ids: np.ndarray | None = None,
) -> GenerationOutput:
    """``generate`` of a prompt batch; ``decoder_ids`` [rows, length]: the rows' decoder prompts (one length)."""
    if _positions_by_column(stepper) and not mask.all():
        return _generate_by_length(stepper, ids, mask, config)
    with flushing_scope(stepper):
        if config.num_beams > 1:
            return _beam_search(stepper, ids, mask, config, decoder_ids)
        # Each step's arrays kept as they come and sorted into prompts after the last: the loop between two model
        # calls does no more than it must (_steps never writes an array it has yielded).
        record = [(prompts, next_ids) for prompts, next_ids, _ in _steps(stepper, ids, mask, config, decoder_ids)]
    tokens: list[list[int]] = [[] for _ in range(len(ids))]
    for prompts, next_ids in record:
        for prompt, token in zip(prompts.tolist(), next_ids.tolist(), strict=True):
            tokens[prompt].append(token)
    return GenerationOutput([np.asarray(t, np.int64) for t in tokens], _pad_id(config))


def flushing_scope(stepper: TokenStepper):
    """One denormal scope for a whole generation on this thread (``KVCacheStepper.flushing``,
    ``MHASession.flushing``) instead of one per model call, each about 5-15 us of a step's host time.

    Safe because: the scope is entered and left on this thread within one ``generate`` call, whose loop never hands
    control back to the caller in between (``stream`` does, so it keeps a scope per call, never one across its
    yields): the caller's own arithmetic keeps its denormals. What runs flushed in between is the search's numpy over
    the logits, and flushing changes none of its results: the logits come from ORT already flushed, so none is a
    denormal; ``log_softmax`` and the softmax of sampling add terms below 1.2e-38 (what flushing zeroes in float32)
    to sums of at least 1, where they are below rounding; ``draw_tokens`` works in float64 on probabilities of at
    least exp(-104) (the least float32 log-probability), far from float64's denormals; top-p compares cumulative
    masses with 1 - top_p, at least 1e-16; argmax, top-k, penalties and biases compare or scale scores that are not
    denormal. A stepper without ``flushing`` (any other ``TokenStepper``): nothing."""
    flushing = getattr(stepper, "flushing", None)
    return flushing() if flushing is not None else contextlib.nullcontext()


def _positions_by_column(stepper: TokenStepper) -> bool:
    """Whether the stepper's file numbers positions by the padded batch's columns (its export measured that a
    row's output moves with padding before it or a hole inside it): prompts of other lengths, or padded at all,
    would then not get what they get alone."""
    graph = getattr(stepper, "graph", None)  # a KVCacheStepper's file; other steppers say nothing of positions
    return getattr(graph, "positions", None) == POSITIONS_PADDED_WIDTH


def _generate_by_length(
    stepper: TokenStepper, ids: np.ndarray, mask: np.ndarray, config: GenerationConfig
) -> GenerationOutput:
    """``generate`` one length at a time, each prompt's real tokens unpadded, so that every prompt gets what it
    gets alone on a file whose positions are its columns; the results in the order given."""
    lengths = mask.sum(axis=1)
    tokens: list[np.ndarray] = [np.zeros(0, np.int64)] * len(ids)
    scores: list[float] | None = [0.0] * len(ids) if config.num_beams > 1 else None
    for length in sorted(set(lengths.tolist())):
        rows = np.flatnonzero(lengths == length)
        prompts = np.stack([ids[row][mask[row] != 0] for row in rows])
        part = generate(stepper, prompts, np.ones_like(prompts), config)
        for index, row in enumerate(rows):
            tokens[row] = part.tokens[index]
            if scores is not None:
                scores[row] = part.scores[index]
    return GenerationOutput(tokens, _pad_id(config), scores)


def stream(
    stepper: TokenStepper,
    input_ids,
    attention_mask=None,
    config: GenerationConfig | None = None,
    **options,
) -> Iterator[StepTokens]:
    """``generate``'s greedy or sampled tokens as they come: one ``StepTokens`` per step, for the prompts
    still running. Beam search cannot stream (a beam's past tokens may still change)."""
    config = _config(config, options, stepper)
    if config.num_beams > 1:
        raise OptionError("beam search cannot stream: its best sequence is known only at the end; use generate")
    ids, mask = prompt_batch(input_ids, attention_mask)
    if _positions_by_column(stepper) and not mask.all():
        raise InputError("this file counts positions over the padded batch's columns, so a padded prompt would not get "
                         "what it gets alone: stream prompts of one length, unpadded (generate splits them itself)")
    return (StepTokens(prompts.copy(), tokens.copy(), finished.copy())
            for prompts, tokens, finished in _steps(stepper, ids, mask, config))


def prompt_batch(input_ids, attention_mask=None, features: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Prompts as (ids int64 [batch, seq], mask int64 [batch, seq]): a list of prompts is padded on the left
    (pad id 0, masked), an array is taken with its mask (default: every token real). ``features``: an encoder's
    features [batch, ...] as given (an array or a list of items of one shape), each item's mask one real column."""
    if features:
        if attention_mask is not None:
            raise InputError("features take no attention_mask: every item is of the size the encoder takes")
        array = np.asarray(input_ids)
        if array.ndim < 2 or array.shape[0] == 0:
            raise InputError(f"features must be [batch, ...] with at least one item, got shape {array.shape}")
        return array, np.ones((len(array), 1), np.int64)
    if _ragged(input_ids):
        if attention_mask is not None:
            raise InputError("a list of prompts carries its own lengths: give attention_mask only with an array")
        prompts = [np.asarray(p).ravel() for p in input_ids]
        for row, prompt in enumerate(prompts):
            if prompt.size and prompt.dtype.kind not in "iu":
                raise InputError(f"prompt {row} must hold integer token ids, got {prompt.dtype} values")
        width = max((len(p) for p in prompts), default=0)
        ids = np.zeros((len(prompts), width), np.int64)
        mask = np.zeros((len(prompts), width), np.int64)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = prompt.astype(np.int64)
            mask[row, width - len(prompt) :] = 1
    else:
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise InputError(f"input_ids must be integer ids [batch, seq], got {ids.dtype} shape {ids.shape}")
        ids = ids.astype(np.int64)
        mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask).astype(np.int64)
        if mask.shape != ids.shape:
            raise InputError(f"attention_mask must have input_ids' shape {ids.shape}, got {mask.shape}")
    if ids.shape[0] == 0:
        raise InputError("no prompt to generate from")
    empty = np.flatnonzero(mask.sum(axis=1) == 0)
    if empty.size:
        raise InputError(f"prompts {empty.tolist()} are empty (no real token): give each at least one token")
    if ids[mask != 0].min() < 0:
        raise InputError("token ids must be non-negative")
    return ids, mask


def _ragged(input_ids) -> bool:
    """A list (or tuple) of prompts, as opposed to one [batch, seq] array."""
    if isinstance(input_ids, np.ndarray):
        return input_ids.dtype == object
    return isinstance(input_ids, list | tuple)


def with_recorded_ids(config: GenerationConfig, stepper: TokenStepper) -> GenerationConfig:
    """``config`` with the ids the stepper's file recorded at export (``stepper.generation_ids``, a
    ``metadata.GenerationIds``) where it leaves them unset (None): what it gives always wins."""
    recorded = getattr(stepper, "generation_ids", None)
    if recorded is None:
        return config
    if config.eos_token_id is None and recorded.eos_token_ids:
        config = replace(config, eos_token_id=list(recorded.eos_token_ids))
    if config.pad_token_id is None and recorded.pad_token_id is not None:
        config = replace(config, pad_token_id=recorded.pad_token_id)
    forced = getattr(recorded, "forced_bos_token_id", None)
    if config.forced_bos_token_id is None and forced is not None:
        config = replace(config, forced_bos_token_id=forced)
    for name in ("suppress_tokens", "begin_suppress_tokens"):
        if getattr(config, name) is None and getattr(recorded, name, None):
            config = replace(config, **{name: list(getattr(recorded, name))})
    return config


def vocab_size(stepper: TokenStepper) -> int | None:
    """How many ids the stepper's model scores, where it says (``KVCacheStepper``: its logits' last axis); None
    when it does not (a stepper of another kind, or a file that leaves the axis open)."""
    return getattr(getattr(stepper, "graph", None), "vocab_size", None)


def _config(config: GenerationConfig | None, options: dict, stepper: TokenStepper) -> GenerationConfig:
    config = config or GenerationConfig()
    unknown = set(options) - set(GenerationConfig.__dataclass_fields__)
    if unknown:
        raise OptionError(f"unknown generation options {sorted(unknown)}; GenerationConfig's fields are the options")
    config = with_recorded_ids(replace(config, **options), stepper)
    config.check_vocabulary(vocab_size(stepper))
    return config


def _pad_id(config: GenerationConfig) -> int:
    if config.pad_token_id is not None:
        return config.pad_token_id
    return config.end_ids[0] if config.end_ids else 0


def _prompt_history(
    stepper: TokenStepper, ids: np.ndarray, mask: np.ndarray, decoder_ids: np.ndarray | None = None
) -> np.ndarray:
    """What each row's history starts with: its real prompt tokens (-1 where padded), or for an encoder-decoder
    its decoder prompt, by default its decoder start id (the prompt went to the encoder)."""
    if decoder_ids is not None:
        return decoder_ids
    start = getattr(stepper, "decoder_start_token_id", None)
    if start is not None:
        return np.full((len(ids), 1), start, np.int64)
    return np.where(mask != 0, ids, -1)


def _steps(
    stepper: TokenStepper, ids: np.ndarray, mask: np.ndarray, config: GenerationConfig,
    decoder_ids: np.ndarray | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Greedy or sampled tokens, one (prompts, tokens, finished) per step as ``StepTokens`` has them: arrays of the
    loop's, never written once yielded (``generate`` keeps them), a step without a finished row yielding one
    all-False array again and again (``stream`` copies all three); a row leaves the stepper when it is finished.

    The loop between two model calls is kept short: at batch 1 each kind of numpy call there costs ~10-20 us, the
    first time after a model call has pushed numpy out of the CPU caches, of an int4 step of ~1.5 ms."""
    processors, criteria = config.logits_processors(), config.stopping_criteria()
    rng = np.random.default_rng(config.seed)
    prompt_history = _prompt_history(stepper, ids, mask, decoder_ids)
    # Every token a row can reach, allocated once (no copy of the history per step): the rules see the columns so
    # far, a view.
    width = prompt_history.shape[1]
    history = np.empty((len(ids), width + config.max_new_tokens), np.int64)
    history[:, :width] = prompt_history
    prompts = np.arange(len(ids))  # the prompt each current row generates for
    _reserve(stepper, ids, config, len(ids))
    logits = _prefill(stepper, ids, mask, decoder_ids)
    generated = 0
    none_finished = np.zeros(len(prompts), bool)
    while True:
        scores = logits if logits.dtype.type is np.float32 else logits.astype(np.float32)
        if processors:
            scores = processors(TokenHistory(history[:, :width], generated), scores)
        next_ids = draw_tokens(scores, rng) if config.do_sample else scores.argmax(axis=-1)
        history[:, width] = next_ids
        width += 1
        generated += 1
        finished = criteria.finished(TokenHistory(history[:, :width], generated))
        if finished is None:
            yield prompts, next_ids, none_finished
        else:
            yield prompts, next_ids, finished
            if finished.all():
                return
            staying = np.flatnonzero(~finished)
            stepper.keep(staying)  # the finished rows' caches are freed here
            prompts, history, next_ids = prompts[staying], history[staying], next_ids[staying]
            none_finished = np.zeros(len(prompts), bool)
        logits = stepper.step(next_ids)


def _prefill(stepper: TokenStepper, ids: np.ndarray, mask: np.ndarray, decoder_ids: np.ndarray | None) -> np.ndarray:
    """The prompts' first logits; an encoder-decoder's decoder from ``decoder_ids`` where given."""
    if decoder_ids is None:
        return stepper.prefill(ids, mask)
    return stepper.prefill(ids, mask, decoder_input_ids=decoder_ids)


def _reserve(stepper: TokenStepper, ids: np.ndarray, config: GenerationConfig, rows: int) -> None:
    """Tell a stepper that can size its cache once (``KVCacheStepper.reserve``) how far the rows can reach: the
    longest prompt and every new token, for ``rows`` rows (beams included)."""
    reserve = getattr(stepper, "reserve", None)
    if reserve is not None:
        reserve(ids.shape[1] + config.max_new_tokens, rows)


def draw_tokens(scores: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token per row drawn from softmax(scores) (filtered scores, -inf, have probability 0)."""
    probabilities = np.exp(log_softmax(scores).astype(np.float64))
    cumulative = np.cumsum(probabilities, axis=-1)
    # u in (0, total]: the first token whose cumulative mass reaches u; a token of mass 0 never does first.
    u = (1.0 - rng.random((len(scores), 1))) * cumulative[:, -1:]
    return np.minimum((cumulative < u).sum(axis=-1), scores.shape[-1] - 1).astype(np.int64)


def _beam_search(
    stepper: TokenStepper, ids: np.ndarray, mask: np.ndarray, config: GenerationConfig,
    decoder_ids: np.ndarray | None = None,
) -> GenerationOutput:
    processors = config.logits_processors()
    scorer = BeamSearchScorer(
        _prompt_history(stepper, ids, mask, decoder_ids),
        config.num_beams,
        config.stopping_criteria(),
        config.max_new_tokens,
        config.end_ids,
        config.length_penalty,
        config.early_stopping,
    )
    _reserve(stepper, ids, config, len(ids) * config.num_beams)
    logits = _prefill(stepper, ids, mask, decoder_ids)
    stepper.keep(scorer.rows)  # each prompt's row repeated once per beam
    logits = logits[scorer.rows]
    while True:
        log_probs = processors(scorer.history(), log_softmax(logits))
        next_ids = scorer.process(log_probs)
        if scorer.done:
            break
        stepper.keep(scorer.rows)
        logits = stepper.step(next_ids)
    results = [scorer.results[i] for i in range(len(ids))]
    return GenerationOutput([tokens for tokens, _ in results], _pad_id(config), [score for _, score in results])
