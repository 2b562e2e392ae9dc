"""A stepper with fixed logits, for the generation loop's tests: what it chooses is then the search's and the
logits processors' doing alone."""

from __future__ import annotations

import numpy as np


class FixedLogits:
    """A stepper whose every row's next-token logits are ``logits``, at every call."""

    decoder_start_token_id = None

    def __init__(self, logits):
        self.logits = np.asarray(logits, np.float32)

    def prefill(self, input_ids, attention_mask):
        return np.tile(self.logits, (len(input_ids), 1))

    def step(self, next_ids):
        return np.tile(self.logits, (len(next_ids), 1))

    def keep(self, rows):
        pass
