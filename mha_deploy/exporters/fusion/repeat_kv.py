"""Grouped-query attention's ``repeat_kv`` read back from a traced graph: the query heads' keys or values as a
repeat of fewer key/value heads.

Why: a grouped-query decoder (Llama, Qwen2, Mistral with fewer KV heads than query heads) projects its keys and
values to ``kv_heads`` and repeats each one for the ``groups`` query heads that share it before the attention
reads them. A cache kept after that repeat holds every KV head ``groups`` times, and ``GroupQueryAttention``
takes the KV heads themselves (``kv_num_heads``). Hugging Face writes the repeat as
``hidden[:, :, None].expand(b, kvh, groups, s, d).reshape(b, kvh * groups, s, d)``, which torch's exporter
traces as

    source [batch, kvh, seq, d] -> Unsqueeze(axes=[2]) -> Expand [batch, kvh, groups, seq, d]
                                 -> Reshape [batch, kvh * groups, seq, d]

Query head ``h`` then reads KV head ``h // groups`` (the merged axis is KV head major), which is
``GroupQueryAttention``'s grouping (head ``h`` of ``num_heads`` reads KV head ``h / (num_heads / kv_num_heads)``).
That it is this repeat, and not another Expand/Reshape (a tile, a broadcast of the batch), is read from the
shapes the graph records: the Unsqueeze inserts axis 2, the Expand changes only that axis (every other dim the
source's own, symbol for symbol), and the Reshape merges exactly it into the heads (batch, length and head size
kept). A graph whose shapes are not recorded that far is not read as a repeat.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir


@dataclass(frozen=True)
class RepeatedHeads:
    """``repeated`` [batch, kv_heads * groups, seq, head_dim] is ``source`` [batch, kv_heads, seq, head_dim] with
    each head repeated ``groups`` times in place; ``unsqueeze`` is the repeat's first node (it reads ``source``)."""

    source: ir.Value
    unsqueeze: ir.Node
    repeated: ir.Value
    kv_heads: int
    groups: int


def repeated_heads(value: ir.Value | None) -> RepeatedHeads | None:
    """``value`` read as ``repeat_kv`` of fewer heads (the module docstring), or None when it is not one."""
    reshape = value.producer() if value is not None else None
    if reshape is None or reshape.op_type != "Reshape" or reshape.domain not in ("", "ai.onnx"):
        return None
    expand = reshape.inputs[0].producer()
    if expand is None or expand.op_type != "Expand" or expand.domain not in ("", "ai.onnx"):
        return None
    unsqueeze = expand.inputs[0].producer()
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or len(unsqueeze.inputs) != 2:
        return None
    if _ints(unsqueeze.inputs[1]) not in ([2], [-3]):
        return None
    source = unsqueeze.inputs[0]
    shapes = [source.shape, expand.outputs[0].shape, value.shape]
    if any(shape is None for shape in shapes) or [shape.rank() for shape in shapes] != [4, 5, 4]:
        return None
    source_dims, expanded, repeated = (list(shape) for shape in shapes)
    kv_heads, groups, heads = source_dims[1], expanded[2], repeated[1]
    if not all(isinstance(dim, int) for dim in (kv_heads, groups, heads, source_dims[3])):
        return None
    # The Expand broadcasts only the inserted axis: every other dim is the source's own (a symbol the same symbol).
    kept = [expanded[0], expanded[1], expanded[3], expanded[4]]
    if not all(_same(a, b) for a, b in zip(kept, source_dims, strict=True)):
        return None
    # The Reshape merges (kv_heads, groups) into the heads, KV head major, and keeps batch, length and head size.
    if heads != kv_heads * groups or groups < 2:
        return None
    if not (_same(repeated[0], source_dims[0]) and _same(repeated[2], source_dims[2])
            and _same(repeated[3], source_dims[3])):
        return None
    return RepeatedHeads(source, unsqueeze, value, kv_heads, groups)


def _same(a, b) -> bool:
    """Two dims known equal: the same int, or the same named symbol (an unnamed one equals nothing)."""
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    return a.value is not None and a.value == b.value


def _ints(value: ir.Value | None) -> list[int] | None:
    """A constant int tensor's values (an initializer or a Constant's output), None when it is not one."""
    if value is None:
        return None
    tensor = value.const_value
    if tensor is None:
        producer = value.producer()
        if producer is None or producer.op_type != "Constant" or "value" not in producer.attributes:
            return None
        tensor = producer.attributes["value"].as_tensor()
    return [int(v) for v in np.asarray(tensor.numpy()).reshape(-1)]
