"""Batching options, typed and declared once: each field's default and its check live here, nowhere else.

``RunnerOptions`` are the offline ones (``BatchRunner``, dataset jobs locally
and on Ray); ``BatchingConfig`` the server's micro-batcher's. Both bound a batch
by ``max_batch_tokens``, its padded positions (items × longest sequence); the
server's per-request cap is another thing, ``RequestLimits.max_item_tokens``.

Neither onnxruntime nor torch is imported, so the CLI takes its defaults from here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mha_deploy.errors import BatchingConfigError, InputError
from mha_deploy.metadata import ON_ERROR_CHOICES

__all__ = ["DEFAULT_BUCKET_WINDOW", "BatchingConfig", "RunnerOptions"]

DEFAULT_BUCKET_WINDOW = 256


@dataclass(frozen=True)
class RunnerOptions:
    """How ``BatchRunner`` cuts items into batches, and what it does at a bad one.

    ``batch_size`` caps the items per batch and ``max_batch_tokens`` the padded
    positions; either may be None, not both. ``bucket_window`` items are read
    ahead and sorted by length; 0 keeps input order (no bucketing). ``on_error``:
    "stop" raises ``InputError`` at the first bad item, "skip" leaves it out and
    records it.
    """

    batch_size: int | None = 16
    max_batch_tokens: int | None = None
    bucket_window: int = DEFAULT_BUCKET_WINDOW
    on_error: str = "stop"

    def __post_init__(self):
        if self.batch_size is not None and self.batch_size < 1:
            raise InputError(f"batch size must be at least 1, got {self.batch_size}")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise InputError(f"max batch tokens must be at least 1, got {self.max_batch_tokens}")
        if self.batch_size is None and self.max_batch_tokens is None:
            raise InputError("give a batch size, a token budget (max batch tokens), or both")
        if self.bucket_window < 0:
            raise InputError(f"bucket window must be 0 (no bucketing) or more, got {self.bucket_window}")
        if self.on_error not in ON_ERROR_CHOICES:
            raise InputError(f"on_error must be one of {', '.join(ON_ERROR_CHOICES)}, got {self.on_error!r}")

    @property
    def window_items(self) -> int:
        """Items read ahead before batching: the memory bound of a run, in items."""
        return self.bucket_window or max(self.batch_size or 0, DEFAULT_BUCKET_WINDOW)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class BatchingConfig:
    """The HTTP/gRPC server's micro-batching (``MicroBatcher``)."""

    # Most requests in one padded run; 1 turns micro-batching off.
    max_batch: int = 32
    # Longest a request waits for others to join its batch.
    max_wait_ms: float = 2.0
    # Batches run at once, each in its own thread (they share ORT's intra-op pool).
    workers: int = 1
    # Items waiting for a batch; beyond it requests are refused (503 / UNAVAILABLE).
    max_queue: int = 4096
    # Padded positions (items × longest sequence) in one ORT run: bounds a run's memory.
    max_batch_tokens: int = 8192
    # Share of padded positions a batch may hold (beyond a few per item) before it is cut.
    max_padding: float = 0.10

    def __post_init__(self):
        sizes = (self.max_batch, self.workers, self.max_queue, self.max_batch_tokens)
        if min(sizes) < 1 or self.max_wait_ms < 0 or not 0 <= self.max_padding < 1:
            raise BatchingConfigError(
                "max_batch, workers, max_queue, max_batch_tokens must be >= 1, max_wait_ms >= 0, 0 <= max_padding < 1"
            )
