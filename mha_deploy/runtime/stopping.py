"""Stopping criteria: when a row's sequence is finished. No torch.

As transformers' ``StoppingCriteria`` (same names), on numpy: each criterion looks at the rows'
histories, the token just chosen included, and says which rows are finished. The search decides
what a finished row means: it leaves the batch (greedy, sampling) or becomes a hypothesis (beams).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from mha_deploy.errors import OptionError
from mha_deploy.runtime.logits import TokenHistory, token_ids


class StoppingCriteria:
    """``criterion(history) -> bool [rows]``: True where a row is finished after its last token."""

    def __call__(self, history: TokenHistory) -> np.ndarray:
        raise NotImplementedError

    def finished(self, history: TokenHistory) -> np.ndarray | None:
        """The same rows, or None where no row is finished: what the search asks after every decoded token, so
        that a step that ends nothing makes no array (criteria that can tell it cheaper say so here)."""
        said = self(history)
        return said if said.any() else None


class StoppingCriteriaList(list):
    """A row is finished when any criterion says so."""

    def __call__(self, history: TokenHistory) -> np.ndarray:
        finished = self.finished(history)
        return np.zeros(history.tokens.shape[0], bool) if finished is None else finished

    def finished(self, history: TokenHistory) -> np.ndarray | None:
        """The finished rows, or None where no criterion finished any (``StoppingCriteria.finished``)."""
        finished = None
        for criterion in self:
            said = criterion.finished(history)
            if said is not None:
                finished = said if finished is None else finished | said
        return finished


class EosTokenCriteria(StoppingCriteria):
    """A row ends on any of ``eos_token_id`` (end-of-sequence and stop ids alike); the id stays in its output."""

    def __init__(self, eos_token_id: int | Iterable[int]):
        self.eos_token_ids = np.asarray(token_ids(eos_token_id), np.int64)
        if not self.eos_token_ids.size:
            raise OptionError("EosTokenCriteria needs at least one token id")
        # One id (most models): compared as a scalar, one array op a token instead of three.
        self._single = int(self.eos_token_ids[0]) if self.eos_token_ids.size == 1 else None

    def __call__(self, history: TokenHistory) -> np.ndarray:
        last = history.tokens[:, -1]
        if self._single is not None:
            return last == self._single
        # A broadcast compare, not np.isin: isin sorts and dispatches (~20 us), run once every decoded token.
        return (last[:, None] == self.eos_token_ids).any(axis=1)

    def finished(self, history: TokenHistory) -> np.ndarray | None:
        tokens = history.tokens
        if self._single is not None and len(tokens) == 1:
            # One row (batch-1 decoding): its last token read as a scalar; the three array calls of the general
            # path cost ~30 us after every int4 step (numpy's code is out of the CPU caches by then).
            return np.ones(1, bool) if tokens[0, -1] == self._single else None
        return super().finished(history)


class MaxNewTokensCriteria(StoppingCriteria):
    """Every row ends once it has generated ``max_new_tokens`` tokens."""

    def __init__(self, max_new_tokens: int):
        if max_new_tokens < 1:
            raise OptionError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        self.max_new_tokens = int(max_new_tokens)

    def __call__(self, history: TokenHistory) -> np.ndarray:
        return np.full(history.tokens.shape[0], history.generated >= self.max_new_tokens)

    def finished(self, history: TokenHistory) -> np.ndarray | None:
        return self(history) if history.generated >= self.max_new_tokens else None
