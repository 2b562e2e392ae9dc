"""Real tokens first: the per-row permutation that moves a padding mask's real tokens to the front, in order.

Two rules build on it. causal_gqa: GroupQueryAttention's ``seqlens_k`` can only
say "the first n keys are real", so the real tokens go to the front (a causal row
depends only on the real keys at or before it, in order) and back after the op.
padding_flash: a non-causal attention does not depend on the order of its keys at
all, so a padded batch's keys can be gathered real-first and cut to the longest
row's real count; a batch whose rows hold equally many real keys (a bucket padded
to a fixed length) then has no padded key left and runs the flash kernel.

For a [batch, seq] mask (nonzero = real)::

    dest[b, s] = CumSum(real)[b, s] - 1            for a real token
               = count[b] + CumSum(pad)[b, s] - 1  for padding
    src        = the inverse permutation of dest (ScatterElements)

``gather_rows(x, src)`` is then x compacted, and ``gather_rows(y, dest)`` puts a
compacted y back in place. The rules call these with the rewriter's op builder or
a branch's TapeBuilder (the same API).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir


@dataclass(frozen=True)
class Compaction:
    dest: ir.Value  # int64 [batch, seq]: where each token goes
    src: ir.Value  # int64 [batch, seq]: where each compacted position comes from
    count: ir.Value  # int64 [batch, 1]: real tokens per row


def int64(op, value: int | list[int]) -> ir.Value:
    return op.Constant(value=ir.tensor(np.array(value, np.int64)))


def any_padded(op, mask: ir.Value) -> ir.Value:
    """bool scalar: whether ``mask`` ([batch, seq], int32, 0 = padding) pads any token (an If's condition)."""
    zero = op.Constant(value=ir.tensor(np.array(0, np.int32)))
    padded = op.Cast(op.Equal(mask, zero), to=ir.DataType.INT32)
    return op.Cast(op.ReduceMax(padded, keepdims=0), to=ir.DataType.BOOL)


def longest(op, compaction: Compaction) -> ir.Value:
    """int64 scalar: the most real tokens in a row, at least 1 (a cut with no position has nothing to average)."""
    return op.Max(op.ReduceMax(compaction.count, keepdims=0), int64(op, 1))


def cut(op, index: ir.Value, length: ir.Value) -> ir.Value:
    """The first ``length`` (int64 scalar) positions of each row of ``index`` [batch, seq]."""
    return op.Slice(index, int64(op, [0]), op.Unsqueeze(length, int64(op, [0])), int64(op, [1]))


def real_first(op, mask: ir.Value) -> Compaction:
    """The permutation that puts each row's real tokens of ``mask`` ([batch, seq], nonzero = real) first."""
    one, axis = int64(op, 1), int64(op, 1)
    real = op.Cast(mask, to=ir.DataType.BOOL)
    real_count = op.Cast(real, to=ir.DataType.INT64)
    count = op.ReduceSum(real_count, int64(op, [1]), keepdims=1)
    real_rank = op.Sub(op.CumSum(real_count, axis), one)
    pad_rank = op.Sub(op.CumSum(op.Cast(op.Not(real), to=ir.DataType.INT64), axis), one)
    dest = op.Where(real, real_rank, op.Add(count, pad_rank))
    seq = op.Squeeze(op.Shape(mask, start=1, end=2))
    positions = op.Expand(op.Range(int64(op, 0), seq, one), op.Shape(mask))
    # dest is a permutation of each row, so every element of the data is overwritten.
    src = op.ScatterElements(positions, dest, positions, axis=1)
    return Compaction(dest, src, count)


def gather_rows(op, x: ir.Value, index: ir.Value) -> ir.Value:
    """``x`` [batch, seq, ...] with row b's positions taken in the order of ``index[b]`` ([batch, n] int64)."""
    return op.GatherND(x, op.Unsqueeze(index, int64(op, [-1])), batch_dims=1)
