"""Beam search's bookkeeping, apart from the model call. No torch.

``BeamSearchScorer`` holds every prompt's running beams and finished hypotheses. The loop gives it
each step's log-probabilities; it decides which continuations survive, which hypotheses are kept,
when a prompt is done, and so which cache rows the next call reads (``rows``: a beam's row may be
read twice, or not at all). It follows transformers' beam search (``generate(num_beams=...)``) as
its default settings run it, so that the same scores give the same tokens:

- each step, per prompt, the best ``max(2, 1 + ends) * num_beams`` continuations over all its beams
  (``ends``: how many end ids there are), so that ``num_beams`` survive even if the best all end;
- a continuation that ends (an end id, or the length limit) among the best ``num_beams`` becomes a
  hypothesis scored ``sum of log-probs / new_tokens ** length_penalty``; the best ``num_beams``
  hypotheses are kept;
- a prompt is done when no running beam can beat its worst kept hypothesis, estimated with the
  running beam's length as it is now (``early_stopping=False``, transformers' default), or with the
  length limit (``"never"``, with a positive length penalty), or as soon as it has ``num_beams``
  hypotheses (``True``);
- running scores are float32 sums and a beam that cannot run is -1e9, as there, so that ties fall alike.

Where it departs from transformers, on purpose: transformers also marks a hypothesis slot that holds
nothing yet with -1e9, so a hypothesis scored below -1e9 (``length_penalty`` -20 makes 5 tokens'
-2.0 about -2e14) loses to the empty slot and the prompt comes back with no tokens. Here a slot is
held or empty by a flag, never by its score, and hypothesis scores are float64 with the penalty
bounded (``check_length_penalty``) so that ``new_tokens ** length_penalty`` and the score stay finite:
every prompt ends with a hypothesis, whatever finite penalty it was given.
"""

from __future__ import annotations

import math

import numpy as np

from mha_deploy.errors import OptionError
from mha_deploy.runtime.logits import TokenHistory
from mha_deploy.runtime.stopping import StoppingCriteriaList

IMPOSSIBLE = np.float32(-1.0e9)
# The most ``new_tokens ** |length_penalty|`` may reach: a sum of float32 log-probabilities (at most 3.4e38 in
# size) divided or multiplied by it stays within float64 (1.8e308).
MAX_LENGTH_FACTOR_LOG = 250 * math.log(10)


def length_penalty_bound(max_new_tokens: int) -> float:
    """The largest ``|length_penalty|`` for which every hypothesis score up to ``max_new_tokens`` tokens is finite
    (infinite when every hypothesis has one token: 1 ** anything is 1)."""
    return math.inf if max_new_tokens <= 1 else MAX_LENGTH_FACTOR_LOG / math.log(max_new_tokens)


def check_length_penalty(length_penalty: float, max_new_tokens: int) -> None:
    """``OptionError`` unless ``length_penalty`` is a finite number within ``length_penalty_bound``."""
    bound = length_penalty_bound(max_new_tokens)
    if (isinstance(length_penalty, bool) or not isinstance(length_penalty, int | float | np.floating)
            or not math.isfinite(length_penalty)):
        raise OptionError(f"length_penalty must be a finite number (1.0 scores by the mean log-probability, 0 by "
                          f"the sum), got {length_penalty!r}")
    if abs(length_penalty) > bound:
        raise OptionError(
            f"length_penalty must be within [-{bound:.4g}, {bound:.4g}] with max_new_tokens={max_new_tokens}, got "
            f"{length_penalty!r}: hypotheses are scored by their log-probability / new_tokens ** length_penalty, "
            "which must stay a finite number up to max_new_tokens tokens"
        )


class BeamSearchScorer:
    """The beams of ``prompts`` (int64 [items, prompt_len], -1 where padded).

    >>> scorer = BeamSearchScorer(prompts, num_beams=4, ...)
    >>> stepper.keep(scorer.rows)                  # after the prefill: each prompt's row, num_beams times
    >>> next_ids = scorer.process(log_probs)       # [rows, vocab] -> the running beams' new tokens
    >>> stepper.keep(scorer.rows); stepper.step(next_ids)   # until scorer.done
    """

    def __init__(
        self,
        prompts: np.ndarray,
        num_beams: int,
        criteria: StoppingCriteriaList,
        max_new_tokens: int,
        end_ids: tuple[int, ...] = (),
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
    ):
        if num_beams < 2:
            raise OptionError(f"beam search needs num_beams >= 2, got {num_beams}")
        if early_stopping not in (True, False, "never"):
            raise OptionError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
        check_length_penalty(length_penalty, max_new_tokens)
        self.num_beams = num_beams
        self.criteria = criteria
        self.max_new_tokens = max_new_tokens
        self.candidates = max(2, 1 + len(end_ids)) * num_beams
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping
        self.prompts = np.asarray(prompts, np.int64)
        items = len(self.prompts)
        self.items = np.arange(items)  # the prompts still searching, in row order
        self.generated = 0
        self.running = np.zeros((items, num_beams, 0), np.int64)  # new tokens of each running beam
        # Only the first beam is live at the start: the others would repeat its continuations.
        self.running_scores = np.zeros((items, num_beams), np.float32)
        self.running_scores[:, 1:] = IMPOSSIBLE
        # The kept hypotheses, best first: a slot holds one where ``kept_finished`` says so (its score then
        # whatever the penalty makes it), and is empty (-inf) otherwise.
        self.kept_scores = np.full((items, num_beams), -np.inf, np.float64)
        self.kept_tokens = [[np.zeros(0, np.int64)] * num_beams for _ in range(items)]
        self.kept_finished = np.zeros((items, num_beams), bool)
        self.improvable = np.ones(items, bool)
        self.results: dict[int, tuple[np.ndarray, float]] = {}
        # After the prefill (one row per prompt): every prompt's row, once per beam.
        self.rows = np.repeat(np.arange(items), num_beams)

    @property
    def done(self) -> bool:
        return self.items.size == 0

    def history(self) -> TokenHistory:
        """The running beams' tokens, one row per beam, for the logits processors."""
        prompts = np.repeat(self.prompts[self.items], self.num_beams, axis=0)
        new = self.running.reshape(len(prompts), self.generated)
        return TokenHistory(np.concatenate([prompts, new], axis=1), self.generated)

    def process(self, log_probs: np.ndarray) -> np.ndarray:
        """Advance every searching prompt by one token from ``log_probs`` [items * num_beams, vocab] (processed
        log-softmax scores, rows in beam order). Sets ``rows`` (the current rows the next call reads, in the
        new beam order; prompts that are done leave) and returns the next call's input ids [len(rows)]."""
        n, beams = len(self.items), self.num_beams
        vocab = log_probs.shape[-1]
        total = (log_probs.astype(np.float32).reshape(n, beams, vocab) + self.running_scores[:, :, None]).reshape(n, -1)
        order = _best(total, self.candidates)
        scores = np.take_along_axis(total, order, axis=1)  # [n, candidates]
        source, token = order // vocab, order % vocab
        tokens = np.concatenate([np.take_along_axis(self.running, source[:, :, None], axis=1), token[:, :, None]], 2)
        ends = self._ends(tokens)  # [n, candidates]

        self._keep_hypotheses(tokens, scores, ends)
        # The running beams: the best continuations that did not end.
        alive = scores + ends.astype(np.float32) * IMPOSSIBLE
        best = np.argsort(-alive, axis=1, kind="stable")[:, :beams]
        self.running = np.take_along_axis(tokens, best[:, :, None], axis=1)
        self.running_scores = np.take_along_axis(alive, best, axis=1)
        beam_source = np.take_along_axis(source, best, axis=1)  # [n, beams]: the beam each one continues
        self.generated += 1
        self._check_improvable()

        searching = self.improvable & ~(self.kept_finished.all(axis=1) & (self.early_stopping is True))
        if ends.all() or self.generated >= self.max_new_tokens:
            searching[:] = False
        for index in np.flatnonzero(~searching):
            self._finish(index)
        rows = np.arange(n)[:, None] * beams + beam_source
        self.rows = rows[searching].ravel()
        next_ids = self.running[searching, :, -1].ravel()
        self._select(np.flatnonzero(searching))
        return next_ids

    def _ends(self, tokens: np.ndarray) -> np.ndarray:
        n, candidates = tokens.shape[:2]
        prompts = np.repeat(self.prompts[self.items], candidates, axis=0)
        history = TokenHistory(np.concatenate([prompts, tokens.reshape(n * candidates, -1)], 1), self.generated + 1)
        return self.criteria(history).reshape(n, candidates)

    def _keep_hypotheses(self, tokens: np.ndarray, scores: np.ndarray, ends: np.ndarray) -> None:
        """Merge the continuations that end among the best ``num_beams`` into the kept hypotheses."""
        beams = self.num_beams
        full = self.kept_finished.all(axis=1, keepdims=True) & (self.early_stopping is True)
        admitted = ends & (np.arange(ends.shape[1]) < beams)[None, :] & ~full & self.improvable[:, None]
        final = np.where(admitted, self._normalised(scores, self.generated + 1), -np.inf)
        merged = np.concatenate([self.kept_scores, final], axis=1)
        held = np.concatenate([self.kept_finished, admitted], axis=1)
        # Held hypotheses before empty slots whatever their scores, then the best first; equal ones in order.
        best = np.lexsort((-merged, ~held), axis=1)[:, :beams]
        for i, picks in enumerate(best):
            pool = self.kept_tokens[i] + list(tokens[i])
            self.kept_tokens[i] = [pool[p] for p in picks]
        self.kept_scores = np.take_along_axis(merged, best, axis=1)
        self.kept_finished = np.take_along_axis(held, best, axis=1)

    def _normalised(self, scores: np.ndarray, length: int) -> np.ndarray:
        """Summed log-probabilities (float32) as a hypothesis of ``length`` new tokens scores: float64, where the
        bounded penalty keeps ``length ** length_penalty`` and the quotient finite."""
        return scores.astype(np.float64) / float(length) ** self.length_penalty

    def _check_improvable(self) -> None:
        """Whether a running beam may still beat the worst kept hypothesis (see the module's docstring)."""
        # With a length penalty that favours length, "never" assumes a beam may yet run to the limit.
        longest = self.early_stopping == "never" and self.length_penalty > 0.0
        length = self.max_new_tokens if longest else self.generated
        best_running = self._normalised(self.running_scores[:, 0], length)
        # Held hypotheses are first: the last slot is the worst one, or empty (then any running beam may fill it).
        room = ~self.kept_finished[:, -1]
        self.improvable &= room | (best_running > self.kept_scores[:, -1])

    def _finish(self, index: int) -> None:
        # The kept hypotheses are sorted, held ones first; a prompt always finishes holding one (the last step's
        # best continuations all end, and are admitted unless the slots are already held).
        self.results[int(self.items[index])] = (self.kept_tokens[index][0], float(self.kept_scores[index, 0]))

    def _select(self, keep: np.ndarray) -> None:
        self.items = self.items[keep]
        self.running = self.running[keep]
        self.running_scores = self.running_scores[keep]
        self.kept_scores = self.kept_scores[keep]
        self.kept_tokens = [self.kept_tokens[i] for i in keep]
        self.kept_finished = self.kept_finished[keep]
        self.improvable = self.improvable[keep]


def _best(values: np.ndarray, k: int) -> np.ndarray:
    """Per row, the indices of the ``k`` largest values, largest first, equal values in index order (what a
    stable sort of the whole row gives), without sorting the whole row: a row is num_beams * vocab long."""
    k = min(k, values.shape[1])
    kth = -np.partition(-values, k - 1, axis=1)[:, k - 1]
    best = np.empty((len(values), k), np.int64)
    for row, (scores, floor) in enumerate(zip(values, kth, strict=True)):
        candidates = np.flatnonzero(scores >= floor)  # k of them, more when several equal the k-th
        best[row] = candidates[np.lexsort((candidates, -scores[candidates]))][:k]
    return best
