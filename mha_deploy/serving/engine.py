"""Continuous batching of a KV-cache decoder: one decode loop (a thread) per model, requests joining and leaving it
between steps. No torch, no HTTP (the server's routes are adapters over ``GenerationEngine``). What the loop decides
-- who starts, how much prefill a turn takes, which cohort a row joins, when cohorts merge, what the KV budget
allows -- is planned in ``serving.scheduler`` (pure functions of the engine's state, tested without a model); this
module runs that plan on the ``KVCacheStepper``.

Each turn of the loop:

1. Cancelled requests leave (their cache rows are dropped with ``KVCacheStepper.keep``), and waiting requests are
   admitted in arrival order while the KV budget holds them (``KVBudget``: planned from each request's prompt and
   ``max_new_tokens``, never from what it happens to use).
2. Prefill, within ``prefill_chunk`` prompt tokens per turn: an admitted prompt runs alone in a stepper forked from the
   model's (``KVCacheStepper.fork``), a long one in chunks over several turns (``extend``), so that the running rows
   keep stepping between its chunks. Its first token is chosen from the prefill's logits (a request that asks for its
   prompt's log probabilities gets the logits of every prompt position, which the file computes anyway, and each
   chunk's are scored as they come), and its cache rows join a running cohort (``KVCacheStepper.join``: the narrower
   cache gets masked holes on the left).
3. One decode step per cohort: every running row's last token in, one logits row out; each row chooses its next
   token with its own settings (its own ``GenerationConfig``'s logits processors -- temperature, top-k/top-p,
   repetition, presence and frequency penalties, logit bias -- and stopping criteria, its own seeded generator), and
   finished rows leave at once.

**Exactness.** A row must get the tokens it gets alone. Holes take no position when the file takes ``position_ids``
(the stepper counts each row's real tokens), so then every row shares one cohort whatever its length
(``mix_lengths``). A file whose own positions count over the cache's width (``export --module --kv-cache`` of a model
with absolute positions exported without ``--position-ids``) would shift a row's positions by its holes: there a row
joins only a cohort of exactly its length (no holes ever), and cohorts of different lengths take one call each per
turn; two cohorts that become aligned merge. ``runtime.kv_stepper.mixes_lengths_exactly`` decides, the rule
``generate``'s prompt batches follow too: a ragged cache mixes lengths (each row at its own length, no holes), and
so does a file whose export measured that its positions do not matter (metadata positions "none", TinyLM);
``mix_lengths`` overrides it. An
encoder-decoder is served the same way: its source (token ids, or one item's features: Whisper's ``input_features``)
is encoded whole at prefill, its decoder run over the request's own decoder prompt (the start id alone by default;
a longer prompt is a longer target, aligned as any length is), and rows of different source lengths share a cohort
when the decoder takes ``encoder_attention_mask`` (shorter sources padded and masked), else only rows of one source
length do. Each row's logits processors see its own decoder tokens, so a forced first token (M2M100's target
language) or Whisper's suppressed ids apply to that row alone. Within a cohort the decoder's arithmetic per row does
not depend on the other rows except through masked holes, whose keys get probability 0 exactly; greedy tokens are
held equal to the request alone in the tests.

**Ragged files.** A file whose attentions keep a ragged cache (``KVCacheStepper.ragged``: GroupQueryAttention writes
each row's keys and values at its own length, in place) mixes lengths exactly and has no holes: one cohort whose
buffers are sized from the admitted requests' prompt + max_new_tokens (rows doubling within ``max_running`` and the
budget), a joining row copied into a spare row, a leaving row's place taken by the last row (one row moved).

**Memory.** ``KVBudget`` bounds the cache positions the running requests can ever hold: in a mixed cohort every row
is as wide as the widest (rows x the largest prompt + max_new_tokens; a ragged cohort's buffers are that wide too),
in aligned cohorts each row holds its own length. A request that fits waits in the queue (at most ``max_waiting``),
one that never fits is refused at once, and a full queue refuses with ``EngineBusy``: nothing waits forever, nothing
allocates past the budget (with holes, joining and leaving copy the cohort's cache once, briefly holding both; a
ragged cohort copies the joining row, and all rows only when its buffers grow).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from mha_deploy.errors import InputError, MHADeployError
from mha_deploy.metadata import POSITIONS_NONE
from mha_deploy.runtime.generation import (
    GenerationConfig,
    decoder_prompt_rows,
    draw_tokens,
    flushing_scope,
    with_recorded_ids,
)
from mha_deploy.runtime.kv_stepper import KVCacheStepper, check_features, mixes_lengths_exactly
from mha_deploy.runtime.logits import (
    ForcedBOSTokenLogitsProcessor,
    LogitBiasLogitsProcessor,
    TokenHistory,
    check_token_id,
    log_softmax,
)
from mha_deploy.serving.scheduler import AlignmentKey, KVBudget, Prefilling, Scheduler

logger = logging.getLogger("mha_deploy.serve")


class EngineBusy(MHADeployError):
    """The queue is full (or the engine is stopping): retry later."""


class RequestTooLarge(InputError):
    """A request that could never run here: its prompt and max_new_tokens exceed the KV budget or the model."""


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to generate: ``prompt`` int64 [seq] (at least one token), or for an encoder-decoder whose encoder
    takes features (Whisper's ``input_features``) one item's float features [<the sizes it takes>]; ``config`` its
    settings (greedy or sampled, ``max_new_tokens``, end ids, seed, an encoder-decoder's ``forced_bos_token_id``;
    ``num_beams`` must be 1), ``logprobs`` how many alternatives' log probabilities to report per token (None: none;
    0: the chosen token's only). ``prompt_logprobs``: score the prompt's own tokens too, each under the logits of the
    position before it (OpenAI's ``echo`` with ``logprobs``; needs ``logprobs``, and a decoder-only model: an
    encoder-decoder's prompt is a source that no logits score). ``decoder_prompt`` (an encoder-decoder's): int64
    ids its decoder starts from (Whisper's task and language tokens), the start id put in front where missing, as
    ``runtime.generation.generate`` takes them; None: the start id alone. The config's ids the file recorded at
    export (forced first token, suppressed ids) apply where the request leaves them unset, as ``generate``'s do."""

    prompt: np.ndarray
    config: GenerationConfig
    logprobs: int | None = None
    prompt_logprobs: bool = False
    decoder_prompt: np.ndarray | None = None

    @property
    def features(self) -> bool:
        """Whether the prompt is an encoder's features rather than token ids."""
        return np.asarray(self.prompt).dtype.kind == "f"

    @property
    def prefill_length(self) -> int:
        """What the prefill reads, as the scheduler's chunks count it: the prompt's tokens, or one features item's
        last axis (Whisper's frames: what the encoder's cost grows with)."""
        return int(np.shape(self.prompt)[-1]) if self.features else len(self.prompt)

    @property
    def kv_need(self) -> int:
        """Cache positions its row can reach: the prompt (an encoder-decoder's source, which its cross-attention
        cache holds, and the decoder prompt beyond the start id) and every new token; features fill no position,
        as ``generate``'s batches count them: the decoder prompt and the new tokens do."""
        decoder = len(self.decoder_prompt) if self.decoder_prompt is not None else 1
        if self.features:
            return decoder + self.config.max_new_tokens
        return len(self.prompt) + decoder - 1 + self.config.max_new_tokens


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log probability under the model's raw distribution (None for a prompt's first token: nothing
    scores it), and the ``top_logprobs`` likeliest ids {id: logprob}, likeliest first, when asked."""

    token: int
    logprob: float | None
    top_logprobs: dict[int, float] | None = None


def token_logprobs(raw: np.ndarray, tokens: np.ndarray, top: int) -> list[TokenLogprob]:
    """What every route reports, from one place: ``raw`` [n, vocab] log-softmaxed logits, ``tokens`` [n] the ids
    they score, ``top`` how many likeliest alternatives per row (0: none). Ties among the likeliest go to the lower
    id, as a stable sort of the whole vocabulary would give."""
    chosen = raw[np.arange(len(tokens)), tokens]
    if top <= 0:
        return [TokenLogprob(int(t), float(lp)) for t, lp in zip(tokens, chosen, strict=True)]
    top = min(top, raw.shape[1])
    entries = []
    for row, token, logprob in zip(raw, tokens, chosen, strict=True):
        floor = np.partition(row, -top)[-top]  # the top-th largest: no sort of the whole vocabulary
        ids = np.flatnonzero(row >= floor)  # ties at the floor included, then cut after ordering
        ids = ids[np.lexsort((ids, -row[ids]))][:top]
        entries.append(TokenLogprob(int(token), float(logprob), {int(i): float(row[i]) for i in ids}))
    return entries


@dataclass(frozen=True)
class TokenEvent:
    """What a request hears: a new ``token`` (with its log probability under the model's raw distribution, and
    ``top_logprobs`` {id: logprob} when asked), or ``token`` None with ``error`` when the engine failed it.
    ``finish_reason`` is set on the last event: "stop" (an end id, kept as the token), "length" (max_new_tokens),
    "error". The first token's event carries ``prompt_logprobs`` when the request asked (one per prompt token,
    the first unscored)."""

    token: int | None
    finish_reason: str | None = None
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None
    error: str | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


class GenerationObserver:
    """Hooks for metrics; the defaults do nothing (the server's Prometheus metrics override them)."""

    def first_token(self, seconds: float) -> None:  # time from submit to the first token
        pass

    def finished(self, tokens: int, seconds_after_first: float) -> None:  # one request's end
        pass

    def tokens(self, count: int) -> None:  # tokens generated by one turn
        pass

    def state(self, running: int, waiting: int, cache_positions: int) -> None:  # after every turn
        pass


@dataclass(eq=False)
class _Sequence:
    """A request in the engine: its history, its sampler, where its cache is, and whom to tell."""

    request: GenerationRequest
    notify: Callable[[TokenEvent], None]
    submitted: float
    id: int
    # What the logits processors see as the row's tokens, [1, the start's + max_new_tokens], filled up to
    # ``length``: written in place token by token (a list turned into an array every token cost O(length) a token).
    tokens: np.ndarray = field(default_factory=lambda: np.zeros((1, 0), np.int64))
    length: int = 0
    generated: int = 0
    prefilled: int = 0
    stepper: KVCacheStepper | None = None  # its own while prefilling; None once joined to a cohort
    first_token_at: float | None = None
    cancelled: bool = False
    prompt_scores: list[TokenLogprob] | None = None  # the prompt's tokens scored so far (prompt_logprobs)

    def __post_init__(self):
        config = self.request.config
        # What the logits processors see as the row's tokens: an encoder-decoder's decoder prompt (its source went to
        # the encoder), as transformers' processors see decoder_input_ids; else the prompt.
        start = self.request.decoder_prompt
        start = np.asarray(start if start is not None else self.request.prompt, np.int64)
        self.tokens = np.empty((1, len(start) + config.max_new_tokens), np.int64)
        self.tokens[0, : len(start)] = start
        self.length = len(start)
        self.processors = config.logits_processors()
        self.criteria = config.stopping_criteria()
        self.end_ids = set(config.end_ids)
        self.rng = np.random.default_rng(config.seed)
        if self.request.prompt_logprobs:
            self.prompt_scores = [TokenLogprob(int(self.request.prompt[0]), None)]


@dataclass(eq=False)
class _Cohort:
    """Rows stepping together in one cache: ``sequences[i]`` is the stepper's row i."""

    stepper: KVCacheStepper
    sequences: list[_Sequence]

    @property
    def width(self) -> int:
        return self.stepper.mask.shape[1]


class Ticket:
    """A submitted request: ``cancel()`` frees its rows at the next turn (a client that went away)."""

    def __init__(self, engine: GenerationEngine, sequence: _Sequence):
        self._engine = engine
        self._sequence = sequence

    def cancel(self) -> None:
        self._engine._cancel(self._sequence)


class GenerationEngine:
    """The decode loop over one ``KVCacheStepper``'s model (see the module's doc).

    >>> engine = GenerationEngine(KVCacheStepper("lm.onnx"), max_kv_tokens=65536)
    >>> engine.start()
    >>> ticket = engine.submit(GenerationRequest(prompt, GenerationConfig(max_new_tokens=16)), on_event)
    """

    def __init__(
        self,
        stepper: KVCacheStepper,
        *,
        max_kv_tokens: int = 65536,
        max_running: int = 64,
        max_waiting: int = 1024,
        prefill_chunk: int = 512,
        mix_lengths: bool | None = None,
        observer: GenerationObserver | None = None,
    ):
        for name, value in (("max_kv_tokens", max_kv_tokens), ("max_running", max_running),
                            ("max_waiting", max_waiting), ("prefill_chunk", prefill_chunk)):
            if not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        from mha_deploy.batch.generation import prompt_limits

        self.stepper = stepper
        # What a prompt may hold: ids below the (encoder's) vocabulary, and the length the file records.
        self.limits = prompt_limits(stepper)
        self.mix_lengths = mixes_lengths_exactly(stepper) if mix_lengths is None else mix_lengths
        inputs = stepper.graph.inputs
        if self.mix_lengths and ("attention_mask" not in inputs or (
                stepper.encoder is not None and "encoder_attention_mask" not in inputs)):
            raise InputError(f"{stepper.graph.source} cannot mask the holes that mixing lengths leaves (it takes no "
                             "attention_mask" + (" or encoder_attention_mask" if stepper.encoder is not None else "")
                             + "): its requests can share steps only with rows of their own length")
        # The plan (who starts, joins, merges, what the budget allows); this class runs it on the stepper.
        self.scheduler = Scheduler(max_kv_tokens=max_kv_tokens, max_running=max_running, prefill_chunk=prefill_chunk,
                                   mix_lengths=self.mix_lengths, ragged=stepper.ragged,
                                   whole_prompts=stepper.encoder is not None)
        self.max_waiting = max_waiting
        self.observer = observer or GenerationObserver()
        self._lock = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._prefilling: list[_Sequence] = []
        self._cohorts: list[_Cohort] = []
        self._ids = itertools.count()
        self._stopping = False
        self._cancelled = False  # a request was cancelled since the loop last dropped the cancelled ones
        self._thread: threading.Thread | None = None
        self.turns = 0

    # --- what callers use -------------------------------------------------------------------------

    @property
    def budget(self) -> KVBudget:
        return self.scheduler.budget

    @property
    def max_running(self) -> int:
        return self.scheduler.max_running

    @property
    def prefill_chunk(self) -> int:
        return self.scheduler.prefill_chunk

    @property
    def batching(self) -> str:
        """How rows share the cache, in words (the server's startup line and model description say it)."""
        if self.stepper.ragged and not self.mix_lengths:
            return ("continuous batching by length over a ragged cache, as told (mix_lengths off): a request shares a "
                    "cohort only with rows of its exact length, although the file would mix lengths exactly")
        if self.stepper.ragged:
            return ("continuous batching over a ragged cache: requests of any length share one cache, each row at its "
                    "own length with no holes (the file writes each row's keys and values in place); a row joins "
                    "into spare rows and a leaving row is replaced by the last, so the running rows are not copied")
        if self.mix_lengths and "position_ids" in self.stepper.graph.inputs:
            return "continuous batching: requests of any length share one cache (positions from position_ids)"
        if self.mix_lengths and self.stepper.graph.positions == POSITIONS_NONE:
            return ("continuous batching: requests of any length share one cache (the export measured that padding "
                    "before a row does not change it)")
        if self.mix_lengths:
            return ("continuous batching: requests of any length share one cache, as told (mix_lengths): the file "
                    "takes no position_ids, so this is exact only for a model whose tokens do not depend on positions")
        if self.stepper.encoder is not None and "encoder_attention_mask" in self.stepper.graph.inputs:
            return ("continuous batching by target length: sources of any length share a cohort (the decoder masks "
                    "shorter ones, encoder_attention_mask); the decoder counts target positions over the cache width "
                    "and takes no position_ids, so a request joins only rows that have as many target tokens "
                    "(those that started with it)")
        return ("continuous batching by length: the file counts positions over the cache width and takes no "
                "position_ids, so a request shares a cohort only with rows of its exact length (as if alone); "
                "cohorts of other lengths step in their own calls")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="generation-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Finish every accepted request (up to ``timeout`` seconds), then end the loop; new requests are refused."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, request: GenerationRequest, notify: Callable[[TokenEvent], None]) -> Ticket:
        """Queue ``request``; ``notify`` is called from the engine's thread with each ``TokenEvent``. Raises
        ``RequestTooLarge`` for a request that could never run, ``EngineBusy`` when the queue is full."""
        if request.config.num_beams != 1:
            raise InputError("the engine searches no beams: num_beams must be 1")
        request = self._completed(request)
        prompt = request.prompt
        if request.prompt_logprobs and (request.logprobs is None or self.stepper.encoder is not None):
            raise InputError("prompt_logprobs needs logprobs set, and a decoder-only model (an encoder-decoder's "
                             "prompt is its source, which no logits score)")
        if request.prompt_logprobs and self.stepper.last_token_only:
            raise InputError("prompt_logprobs (echo with logprobs) scores every prompt token, and this model computes "
                             "each row's last token's logits only (exported with --logits last): export it again "
                             "with --logits all to serve them")
        bias = request.config.logit_bias
        if bias and self.stepper.graph.vocab_size is not None:
            # Checked here, not at the row's first step: a failure inside the loop would fail every running row.
            LogitBiasLogitsProcessor(bias).check_vocabulary(self.stepper.graph.vocab_size)
        forced = request.config.forced_bos_token_id
        if forced is not None and self.stepper.graph.vocab_size is not None:  # as logit_bias: the processor's check
            ForcedBOSTokenLogitsProcessor(forced).check_vocabulary(self.stepper.graph.vocab_size)
        if not self.scheduler.fits_alone(request.kv_need):
            what = "features" if request.features else f"prompt's {len(prompt)} tokens"
            raise RequestTooLarge(
                f"the {what} and max_tokens {request.config.max_new_tokens} need {request.kv_need} cache positions, "
                f"past this server's --max-kv-tokens {self.budget.max_kv_tokens}")
        sequence = _Sequence(request, notify, time.perf_counter(), next(self._ids))
        with self._lock:
            if self._stopping:
                raise EngineBusy("the server is stopping")
            if len(self._waiting) >= self.max_waiting:
                raise EngineBusy(f"{len(self._waiting)} requests already wait (the server's limit); retry shortly")
            self._waiting.append(sequence)
            self._lock.notify_all()
        return Ticket(self, sequence)

    def _completed(self, request: GenerationRequest) -> GenerationRequest:
        """``request`` checked against the model, as the loop will run it: its source (token ids below the
        vocabulary, or features of the sizes the encoder takes: the one validator's check), an encoder-decoder's
        decoder prompt beginning with the start id, and the ids recorded at export where its config leaves them
        unset (``with_recorded_ids``: a forced first token, suppressed ids)."""
        prompt = np.asarray(request.prompt)
        features = getattr(self.stepper, "source_features", None)
        if features is not None:
            if prompt.dtype.kind != "f":
                raise InputError(f"this model's encoder takes {features.name} features {list(features.axes[1:])} "
                                 "(float), not token ids")
            prompt = check_features(features, prompt[None])[0]
        else:
            if prompt.ndim != 1 or prompt.size == 0 or prompt.dtype.kind not in "iu" or prompt.min() < 0:
                raise InputError("a prompt is a non-empty list of non-negative token ids")
            check_token_id(int(prompt.max()), "prompt", self.limits.vocab)
        config = request.config
        if self.stepper.encoder is None:
            if request.decoder_prompt is not None or config.forced_bos_token_id is not None:
                raise InputError("decoder_prompt and forced_bos_token_id are an encoder-decoder's: this model's "
                                 "decoder starts from the prompt itself")
            return replace(request, prompt=prompt)
        decoder = decoder_prompt_rows(self.stepper, [request.decoder_prompt], 1)[0]
        return replace(request, prompt=prompt, decoder_prompt=decoder, config=with_recorded_ids(config, self.stepper))

    def snapshot(self) -> dict[str, int]:
        """Running and waiting requests, and cache positions held (holes, or a ragged cache's spare rows and
        positions, included)."""
        with self._lock:
            return {"running": self._running_count(), "waiting": len(self._waiting),
                    "cache_positions": self._cache_positions()}

    # --- the loop ---------------------------------------------------------------------------------

    def _cancel(self, sequence: _Sequence) -> None:
        with self._lock:
            sequence.cancelled = True
            self._cancelled = True
            self._lock.notify_all()

    def _running_count(self) -> int:
        return len(self._prefilling) + sum(len(c.sequences) for c in self._cohorts)

    def _cache_positions(self) -> int:
        held = sum(c.stepper.cache_positions for c in self._cohorts)
        return held + sum(s.stepper.cache_positions for s in self._prefilling if s.stepper is not None)

    def _active(self) -> list[_Sequence]:
        return [*self._prefilling, *(s for c in self._cohorts for s in c.sequences)]

    def _loop(self) -> None:
        # One denormal scope for the loop's whole life, on this thread of its own (generation.flushing_scope says why
        # the search's numpy may run in it): the decode steps take their prepared path (kv_stepper._DecodeStep), and
        # no turn pays for entering and leaving it (~10-20 us a turn, a batch-1 step being ~2 ms at int4).
        with flushing_scope(self.stepper):
            self._turns()

    def _turns(self) -> None:
        while True:
            with self._lock:
                self._drop_cancelled()
                self._admit()
                while not self._prefilling and not self._cohorts:
                    self._report()  # idle: what is left waiting (a cancelled waiting request is gone)
                    if self._stopping and not self._waiting:
                        return
                    self._lock.wait()
                    self._drop_cancelled()
                    self._admit()
            try:
                self._turn()
            except Exception as exc:  # an ORT failure: fail every active request, keep serving the next ones
                logger.exception("generation step failed")
                self._fail_all(f"the model failed: {exc}")
            self.turns += 1
            with self._lock:
                self._report()

    def _report(self) -> None:
        self.observer.state(self._running_count(), len(self._waiting), self._cache_positions())

    def _drop_cancelled(self) -> None:
        if not self._cancelled:  # looked at every turn: nothing to rebuild unless a request was cancelled since
            return
        self._cancelled = False
        self._waiting = deque(s for s in self._waiting if not s.cancelled)
        self._prefilling = [s for s in self._prefilling if not s.cancelled]
        for cohort in self._cohorts:
            self._leave(cohort, [s for s in cohort.sequences if s.cancelled])

    def _admit(self) -> None:
        """The waiting requests the scheduler starts (``Scheduler.admitted``) each get a stepper to prefill in."""
        if not self._waiting:
            return
        count = self.scheduler.admitted([s.request.kv_need for s in self._waiting],
                                        [s.request.kv_need for s in self._active()])
        for _ in range(count):
            head = self._waiting.popleft()
            head.stepper = self.stepper.fork()
            if head.stepper.ragged:
                head.stepper.reserve(len(head.request.prompt), 1)  # its prompt, in chunks or not: no regrowth
            self._prefilling.append(head)

    def _turn(self) -> None:
        self._prefill()
        now_tokens = 0
        for cohort in list(self._cohorts):
            last = np.array([s.tokens[0, s.length - 1] for s in cohort.sequences], np.int64)
            logits = cohort.stepper.step(last)
            finished = [s for s, row in zip(cohort.sequences, logits, strict=True) if self._choose(s, row)]
            now_tokens += len(cohort.sequences)
            self._leave(cohort, finished)
        if len(self._cohorts) > 1:  # one cohort has none to merge with (and mixed lengths never make two)
            self._merge_aligned()
        self.observer.tokens(now_tokens)

    def _prefill(self) -> None:
        """This turn's prefill chunks (``Scheduler.prefill_chunks``), oldest request first; a prompt whose prefill
        is done gets its first token and joins a cohort."""
        prefilling = list(self._prefilling)
        plan = self.scheduler.prefill_chunks([Prefilling(s.request.prefill_length, s.prefilled) for s in prefilling])
        for chunk in plan:
            sequence = prefilling[chunk.index]
            if sequence.stepper.encoder is not None:  # the whole source (whole_prompts), its decoder from its prompt
                logits = self._prefill_source(sequence)
            else:
                prompt = sequence.request.prompt
                start = chunk.start
                ids = np.asarray(prompt[start : start + chunk.length], np.int64)[None, :]
                stepper = sequence.stepper
                scored = sequence.prompt_scores is not None
                logits = stepper.prefill(ids, np.ones_like(ids), scored) if start == 0 else stepper.extend(ids, scored)
                if scored:  # [1, chunk, vocab]: column j scores prompt token start + j + 1, the last one the next token
                    self._score_prompt(sequence, start, logits[0])
                    logits = logits[:, -1]
                sequence.prefilled += ids.shape[1]
            if sequence.prefilled < sequence.request.prefill_length:
                continue
            self._prefilling.remove(sequence)
            self.observer.tokens(1)
            if self._choose(sequence, logits[0]):
                sequence.stepper = None
                continue
            self._join(sequence)

    def _prefill_source(self, sequence: _Sequence) -> np.ndarray:
        """An encoder-decoder's prefill: its source (token ids, or one item's features) encoded whole, its decoder
        run over its own decoder prompt (``_completed`` set it: the start id at least); the last logits [1, vocab]."""
        request = sequence.request
        source = np.asarray(request.prompt)[None]
        mask = np.ones((1, 1 if request.features else source.shape[1]), np.int64)
        logits = sequence.stepper.prefill(source, mask, decoder_input_ids=request.decoder_prompt[None, :])
        sequence.prefilled = request.prefill_length
        return logits

    def _score_prompt(self, sequence: _Sequence, start: int, logits: np.ndarray) -> None:
        prompt = sequence.request.prompt
        following = np.asarray(prompt[start + 1 : start + 1 + len(logits)], np.int64)
        if following.size:
            raw = log_softmax(logits[: following.size])
            sequence.prompt_scores.extend(token_logprobs(raw, following, sequence.request.logprobs))

    def _alignment(self, stepper: KVCacheStepper) -> AlignmentKey:
        """What rows must share to step together unmixed: the cache width, and an encoder-decoder's source length
        when its decoder cannot mask a shorter source (no encoder_attention_mask)."""
        source = 0 if "encoder_attention_mask" in stepper.graph.inputs else stepper.source_width
        return stepper.mask.shape[1], source

    def _join(self, sequence: _Sequence) -> None:
        """``sequence``'s prefilled rows join the cohort the scheduler names, or a new one."""
        key = self._alignment(sequence.stepper)
        index = self.scheduler.cohort_for(key, [self._alignment(c.stepper) for c in self._cohorts])
        if index is None:
            target = _Cohort(self.stepper.fork(), [])
            self._cohorts.append(target)
        else:
            target = self._cohorts[index]
        if target.stepper.ragged:
            # Sized before the join, so that the joining row goes into a spare row and the running rows stay put.
            needs = [s.request.kv_need for s in [*target.sequences, sequence]]
            buffers = self.scheduler.cohort_buffers(needs, target.stepper.row_capacity, target.stepper.capacity)
            if buffers is not None:
                target.stepper.reserve(buffers.positions, buffers.rows)
        target.stepper.join(sequence.stepper)
        target.sequences.append(sequence)
        sequence.stepper = None

    def _merge_aligned(self) -> None:
        """Cohorts whose keys met after a step step as one from now on (``Scheduler.merges``)."""
        merges = self.scheduler.merges([self._alignment(c.stepper) for c in self._cohorts])
        for merged, into in merges:
            self._cohorts[into].stepper.join(self._cohorts[merged].stepper)
            self._cohorts[into].sequences.extend(self._cohorts[merged].sequences)
        gone = {merged for merged, _ in merges}
        self._cohorts = [c for i, c in enumerate(self._cohorts) if i not in gone]

    def _leave(self, cohort: _Cohort, leaving: list[_Sequence]) -> None:
        if not leaving:
            return
        staying = self.scheduler.rows_kept(len(cohort.sequences),
                                           {i for i, s in enumerate(cohort.sequences) if s in leaving})
        if not staying:
            self._cohorts.remove(cohort)
            return
        cohort.stepper.keep(np.array(staying, np.int64))
        cohort.sequences = [cohort.sequences[i] for i in staying]

    def _choose(self, sequence: _Sequence, logits: np.ndarray) -> bool:
        """The row's next token from its logits [vocab] with its own settings; tells its owner; True when finished."""
        config = sequence.request.config
        logits = (logits if logits.dtype.type is np.float32 else logits.astype(np.float32))[None, :]
        scores = logits
        if sequence.processors:  # none for plain greedy: no call, no history view (the search's loop does the same)
            try:
                scores = sequence.processors(TokenHistory(sequence.tokens[:, : sequence.length], sequence.generated),
                                             logits)
            except InputError as exc:  # this row's settings do not fit the model (a logit_bias id past an open
                # vocabulary)
                self._notify(sequence, TokenEvent(None, "error", error=str(exc)))
                return True
        token = int(draw_tokens(scores, sequence.rng)[0] if config.do_sample else scores[0].argmax())
        sequence.tokens[0, sequence.length] = token
        sequence.length += 1
        sequence.generated += 1
        history = TokenHistory(sequence.tokens[:, : sequence.length], sequence.generated)
        finished = sequence.criteria.finished(history) is not None
        now = time.perf_counter()
        if sequence.first_token_at is None:
            sequence.first_token_at = now
            self.observer.first_token(now - sequence.submitted)
        logprob = top = None
        wanted = sequence.request.logprobs
        if wanted is not None:
            scored = token_logprobs(log_softmax(logits), np.array([token]), wanted)[0]
            logprob, top = scored.logprob, scored.top_logprobs
        reason = None
        if finished:
            reason = "stop" if token in sequence.end_ids else "length"
            self.observer.finished(sequence.generated, now - sequence.first_token_at)
        prompt_scores = None
        if sequence.prompt_scores is not None and sequence.generated == 1:
            prompt_scores, sequence.prompt_scores = tuple(sequence.prompt_scores), None
        self._notify(sequence, TokenEvent(token, reason, logprob, top, prompt_logprobs=prompt_scores))
        return finished

    def _notify(self, sequence: _Sequence, event: TokenEvent) -> None:
        try:
            sequence.notify(event)
        except Exception:  # a listener that fails (its loop closed) must not stop the others' rows
            logger.exception("a generation listener failed; its request is cancelled")
            sequence.cancelled = self._cancelled = True

    def _fail_all(self, message: str) -> None:
        for sequence in self._active():
            self._notify(sequence, TokenEvent(None, "error", error=message))
        self._prefilling, self._cohorts = [], []
