"""A ragged-layout file's rotary positions moved into its ``GroupQueryAttention`` ops (``do_rotary=1``).

Why: after ``fusion.ragged_cache`` each attention is one op, but the module's rotary stays around it as the
module's own ops: per query and key a Slice, Neg, Concat, two Muls and an Add on the [batch, heads, seq, head_dim]
heads, which were split out of the projection (Reshape, Transpose) only to be rotated and merged back (Transpose,
Reshape), and cos/sin gathered from ``position_ids`` each call. ``GroupQueryAttention`` rotates its query and new
keys itself from ``cos_cache``/``sin_cache`` tables [max_length, head_dim / 2], at the positions each row's
``seqlens_k`` gives (the ragged contract's ``position_ids``: n_r - seq + arange(seq), arange in a first call).

What is rewritten, found structurally: a ``GroupQueryAttention`` without rotary whose query and key inputs are each
the [batch, seq, hidden] merge (Transposes making Transpose(0, 2, 1, 3), Reshape) of ``x * cos + rotate_half(x) *
sin`` with ``rotate_half(x) = Concat(-x[..., h:], x[..., :h])`` (h = d / 2, the form most Hugging Face decoders use)
or its interleaved form ``stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)`` (GLM's, GPT-J's pairs (2i, 2i + 1):
``rotary_interleaved=1``) over the whole head (d = head_dim), or over its first d dims followed by the rest as it
was, ``Concat(rotary(x[..., :d]), x[..., d:])`` (a partial rotary: Phi-4-mini's ``partial_rotary_factor`` 0.75,
GPT-NeoX's 0.25), cos and sin [.., 1, seq, d] computed from ``position_ids`` and constants only. The op's tables are
[max_length, d / 2]: ONNX Runtime rotates the first 2 x their width of each head and passes the rest through (its
CPU kernel, measured exact on 1.31). The tables are not re-derived from a config: the module's own cos/sin subgraph
is cut out and run (``mask_probe.cut_out``) on positions arange(max_length), so a rope scaling (llama3, linear,
yarn's attention factor) and a base per layer are what the module computes. The rewrite is refused, the attention
left as it is, with one line saying why, unless: the query and the keys read the same tables, each table gives both
dims of a rotated pair one angle (its two halves equal, or its even and odd columns interleaved; the op's cache is
one column per pair), a batch of other positions gives each row the table's rows at its positions (nothing but the
position itself reaches cos/sin), and d is a multiple of 16 (ONNX Runtime's rotary takes tables of a multiple of 8
wide: a head of 16 with a partial rotary is refused). Per-step parity under the ragged layout
(``own_kv_cache.check_own_cache_parity``) then checks the positions the op computes against the module's on first
calls with right-padded rows, chunks and one-token steps.

The rotary's Slices, Muls and the cos/sin subgraph are then dead and removed; ``position_ids`` stays an input of
the file (its signature and every runtime feed it; it is n_r - seq + arange(seq), which the op derives itself).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir

from mha_deploy.exporters.fusion import head_round_trip, qkv_packing
from mha_deploy.exporters.fusion.attention_rewrite import AttentionRewriteReport, rewritten
from mha_deploy.exporters.fusion.constant_values import constant_array
from mha_deploy.exporters.fusion.mask_probe import cut_out
from mha_deploy.metadata import ParityReport

_PREFIX = "rotary."
_DOMAIN = "com.microsoft"
_COS_CACHE, _SIN_CACHE = 7, 8  # GroupQueryAttention's inputs
POSITIONS = "position_ids"
REWRITE = "rotary in the op (do_rotary)"  # how a line names this pass
# ``fuse_into_gqa``'s passes by name, in the order it applies them (packing reads what the rotary's removal leaves).
GQA_REWRITES = (REWRITE, qkv_packing.REWRITE, head_round_trip.REWRITE)
# The most a table's two halves may differ and still be one table (their values are equal in the module's
# Concat(freqs, freqs) form; a different tail would be another rotary), and a row of cos/sin evaluated in a batch of
# other positions from the table's row (ORT's vectorised Cos/Sin may round the last bit by the tensor's length).
HALVES_ATOL = 1e-6


class _Refused(Exception):
    """Why one attention keeps the module's rotary (one line)."""


def fuse_rotary_into_gqa(model: onnx.ModelProto,
                         max_length: int | None) -> tuple[onnx.ModelProto, AttentionRewriteReport]:
    """``model`` (a ragged-layout file, ``fusion.ragged_cache``) with each attention's rotary computed by its
    ``GroupQueryAttention`` (the module docstring), and what was done; ``model`` itself where nothing was.
    ``max_length``: the longest sequence the file takes, the tables' length (None: nothing is fused, the tables
    would bound the file)."""
    ir_model = ir.serde.deserialize_model(model)
    graph = ir_model.graph
    # An attention no cos/sin reaches has no rotary to move (GPT-2's learned positions): not a refusal.
    attentions = [node for node in graph if node.op_type == "GroupQueryAttention" and node.domain == _DOMAIN
                  and not node.attributes.get_int("do_rotary", 0) and _reads_trig(node.inputs[0])]
    report = AttentionRewriteReport(REWRITE, attentions=len(attentions))
    if not attentions:
        return model, report
    positions = next((value for value in graph.inputs if value.name == POSITIONS), None)
    plans = []
    tables = _Tables(positions, max_length)
    for node in attentions:
        try:
            plans.append(_plan(node, tables))
        except _Refused as exc:
            report.refused.append(f"{node.name}: {exc}")
    for plan in plans:
        plan.apply(graph, tables)
    report.done = len(plans)
    return rewritten(model, ir_model, report)


@dataclass
class _Rotated:
    """One rotated input: ``x`` the [batch, heads, seq, head_dim] heads before the rotary, ``cos``/``sin`` the
    values its first ``dim`` dims are multiplied by (``dim`` the head size, or less for a partial rotary)."""

    x: ir.Value
    cos: ir.Value
    sin: ir.Value
    dim: int
    interleaved: bool = False  # pairs (2i, 2i + 1) rotated (GLM's, GPT-J's form), not (i, i + dim / 2)


@dataclass
class _Plan:
    node: ir.Node
    query: _Rotated
    key: _Rotated
    heads: int
    kv_heads: int
    head_dim: int

    def apply(self, graph: ir.Graph, tables: _Tables) -> None:
        node = self.node
        name = node.name or "GroupQueryAttention"
        node.replace_input_with(0, _merged(graph, self.query.x, self.heads * self.head_dim, f"{name}.query"))
        node.replace_input_with(1, _merged(graph, self.key.x, self.kv_heads * self.head_dim, f"{name}.key"))
        cos, sin = tables.initializers(graph, self.query)
        node.resize_inputs(max(len(node.inputs), _SIN_CACHE + 1))
        node.replace_input_with(_COS_CACHE, cos)
        node.replace_input_with(_SIN_CACHE, sin)
        node.attributes["do_rotary"] = ir.AttrInt64("do_rotary", 1)
        node.attributes["rotary_interleaved"] = ir.AttrInt64("rotary_interleaved", int(self.query.interleaved))


def _plan(node: ir.Node, tables: _Tables) -> _Plan:
    heads = node.attributes.get_int("num_heads", 0)
    kv_heads = node.attributes.get_int("kv_num_heads", 0)
    past = node.inputs[3] if len(node.inputs) > 3 else None
    if past is None or past.shape is None or past.shape.rank() != 4 or not isinstance(past.shape[3], int):
        raise _Refused("its past keys are not [batch, kv_heads, past, head_dim] with a static head_dim")
    head_dim = past.shape[3]
    if len(node.inputs) > _COS_CACHE and any(value is not None for value in node.inputs[_COS_CACHE:]):
        raise _Refused("it takes inputs after total_sequence_length already")
    rotated = []
    for index, role in ((0, "query"), (1, "key")):
        value = node.inputs[index] if len(node.inputs) > index else None
        rotated.append(_rotated(_heads_of(value, role), head_dim, role))
    query, key = rotated
    if query.dim != key.dim:
        raise _Refused(f"its query rotates {query.dim} dims of a head and its keys {key.dim}")
    if query.interleaved != key.interleaved:
        raise _Refused("its query and its keys rotate different pairs of dims (one interleaved)")
    # ONNX Runtime's check (group_query_attention_helper): cos_cache's width, half the rotated dims, a multiple of 8
    # (its vectorised rotary) and at most half the head; the dims after it pass through (measured, ORT 1.31 CPU).
    if query.dim % 16:
        raise _Refused(f"it rotates {query.dim} dims of each head{'' if query.dim == head_dim else ' (partial)'}, "
                       "where GroupQueryAttention's rotary takes multiples of 16")
    cos, sin = tables.read(query), tables.read(key)
    if not (np.array_equal(cos[0], sin[0]) and np.array_equal(cos[1], sin[1])):
        raise _Refused("its query and its keys are rotated by different tables")
    return _Plan(node, query, key, heads, kv_heads, head_dim)


def _reads_trig(value: ir.Value | None, limit: int = 64) -> bool:
    """Whether a Cos or Sin computes ``value`` (within ``limit`` nodes back, not through a projection)."""
    stack, seen = [value], set()
    while stack and len(seen) < limit:
        node = stack.pop().producer() if stack[-1] is not None else stack.pop()
        if node is None or id(node) in seen or node.op_type in ("MatMul", "Gemm", "MatMulNBits"):
            continue
        seen.add(id(node))
        if node.op_type in ("Cos", "Sin"):
            return True
        stack.extend(node.inputs)
    return False


def _heads_of(value: ir.Value | None, role: str) -> ir.Value:
    """The [batch, heads, seq, head_dim] tensor ``value`` [batch, seq, hidden] merges (Reshape of Transposes that
    make Transpose(0, 2, 1, 3) together: sdpa's keys come transposed for the scores and back, GPT-NeoX's)."""
    reshape = value.producer() if value is not None else None
    if reshape is None or reshape.op_type != "Reshape":
        raise _Refused(f"its {role} is not merged from [batch, heads, seq, head_dim] heads (no rotary on them)")
    heads, perm = reshape.inputs[0], list(range(4))
    while (producer := heads.producer()) is not None and producer.op_type == "Transpose":
        step = list(producer.attributes.get_ints("perm", [3, 2, 1, 0]))
        if len(step) != 4:
            break
        perm = [step[axis] for axis in perm]
        heads = producer.inputs[0]
    if perm != [0, 2, 1, 3]:
        raise _Refused(f"its {role} is not merged from [batch, heads, seq, head_dim] heads (no rotary on them)")
    return heads


def _rotated(value: ir.Value, head_dim: int, role: str) -> _Rotated:
    """``value`` read as ``x * cos + rotate_half(x) * sin`` over the whole head (the module docstring's form), or
    as a partial rotary: Concat(that form over x[..., :d], x[..., d:]) along the head (Phi-4-mini, GPT-NeoX), the
    dims after ``d`` passed through as they are."""
    if value.shape is None or value.shape.rank() != 4 or value.shape[3] != head_dim:
        raise _Refused(f"its {role} heads are not [batch, heads, seq, {head_dim}]")
    concat = value.producer()
    if concat is not None and concat.op_type == "Concat" and len(concat.inputs) == 2 \
            and concat.attributes.get_int("axis", 0) in (-1, 3):
        rotated, passed = concat.inputs
        kept = passed.producer()
        if kept is not None and kept.op_type == "Slice" and rotated.producer() is not None:
            x = kept.inputs[0]
            dim = _slice_start(passed)
            if dim is not None and 0 < dim < head_dim and _is_slice(passed, x, dim, head_dim, head_dim):
                found = _rotated_sum(rotated, dim, role)
                if not _is_slice(found.x, x, 0, dim, head_dim):
                    raise _Refused(f"its {role} rotates x[..., :{dim}] of one tensor and passes the rest of another")
                return _Rotated(x, found.cos, found.sin, dim, found.interleaved)
    return _rotated_sum(value, head_dim, role)


def _rotated_sum(value: ir.Value, dim: int, role: str) -> _Rotated:
    """``value`` read as ``x * cos + rotate_half(x) * sin`` over the ``dim`` dims of ``x``, any operand order."""
    add = value.producer()
    if add is None or add.op_type != "Add" or len(add.inputs) != 2:
        raise _Refused(f"its {role} is not x * cos + rotate_half(x) * sin")
    products = [v.producer() for v in add.inputs]
    if any(p is None or p.op_type != "Mul" or len(p.inputs) != 2 for p in products):
        raise _Refused(f"its {role} is not x * cos + rotate_half(x) * sin")
    for straight, turned in (products, products[::-1]):
        for x, cos in (straight.inputs, straight.inputs[::-1]):
            for half, sin in (turned.inputs, turned.inputs[::-1]):
                if _is_rotate_half(half, x, dim):
                    return _Rotated(x, cos, sin, dim)
                if _is_rotate_pairs(half, x, dim):
                    return _Rotated(x, cos, sin, dim, interleaved=True)
    raise _Refused(f"its {role}'s rotary over its first {dim} dims is neither rotate_half nor its interleaved "
                   "form")


def _is_rotate_half(value: ir.Value, x: ir.Value, dim: int) -> bool:
    """Whether ``value`` is Concat(Neg(x[..., h:]), x[..., :h]) along the last axis of ``x`` (``dim`` wide),
    h = dim / 2."""
    concat = value.producer()
    if concat is None or concat.op_type != "Concat" or len(concat.inputs) != 2 \
            or concat.attributes.get_int("axis", 0) not in (-1, 3):
        return False
    neg = concat.inputs[0].producer()
    if neg is None or neg.op_type != "Neg":
        return False
    half = dim // 2
    return _is_slice(neg.inputs[0], x, half, dim, dim) and _is_slice(concat.inputs[1], x, 0, half, dim)


def _is_rotate_pairs(value: ir.Value, x: ir.Value, dim: int) -> bool:
    """Whether ``value`` is the interleaved rotate_half, stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2) as
    torch writes it: Reshape(Concat(Unsqueeze(Neg(odd)), Unsqueeze(even)) on a new last axis). The Reshape's
    shape is computed from the input's in the graph and not read here: its output's last dim is checked where
    known, and a wrong one fails the file's parity, which drops the rewrite."""
    reshape = value.producer()
    if reshape is None or reshape.op_type != "Reshape":
        return False
    if value.shape is not None and value.shape.rank() and value.shape[-1] != dim and isinstance(value.shape[-1], int):
        return False
    concat = reshape.inputs[0].producer()
    if concat is None or concat.op_type != "Concat" or len(concat.inputs) != 2 \
            or concat.attributes.get_int("axis", 0) not in (-1, 4):
        return False
    odd, even = (_new_last_axis(value) for value in concat.inputs)
    if odd is None or even is None:
        return False
    neg = odd.producer()
    if neg is None or neg.op_type != "Neg":
        return False
    return _is_slice(neg.inputs[0], x, 1, dim, dim, step=2) and _is_slice(even, x, 0, dim, dim, step=2)


def _new_last_axis(value: ir.Value) -> ir.Value | None:
    """``u`` where ``value`` is Unsqueeze(u) on a new last axis of a [batch, heads, seq, d] ``u``, else None."""
    node = value.producer()
    if node is None or node.op_type != "Unsqueeze" or len(node.inputs) != 2:
        return None
    axes = constant_array(node.inputs[1])
    return node.inputs[0] if axes is not None and axes.size == 1 and int(axes.item()) in (-1, 4) else None


def _slice_constants(value: ir.Value) -> tuple[int, int, int, int] | None:
    """(start, end, axis, step) of the one-axis Slice computing ``value`` from constants, else None."""
    node = value.producer()
    if node is None or node.op_type != "Slice" or len(node.inputs) < 4:
        return None
    starts, ends, axes = (constant_array(node.inputs[i]) for i in (1, 2, 3))
    steps = constant_array(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else np.ones(1)
    if any(array is None or array.size != 1 for array in (starts, ends, axes, steps)):
        return None
    return int(starts.item()), int(ends.item()), int(axes.item()), int(steps.item())


def _slice_start(value: ir.Value) -> int | None:
    """Where the last-axis Slice computing ``value`` starts, else None."""
    found = _slice_constants(value)
    return found[0] if found is not None and found[2] in (-1, 3) and found[3] == 1 else None


def _is_slice(value: ir.Value, x: ir.Value, start: int, end: int, width: int, step: int = 1) -> bool:
    """Whether ``value`` is x[..., start:end:step] along x's last axis, ``width`` wide (an end past it, its end)."""
    node = value.producer()
    found = _slice_constants(value)
    if found is None or node.inputs[0] is not x:
        return False
    first, last, axis, stride = found
    return axis in (-1, 3) and stride == step and first == start \
        and (last == end or (end == width and last > width))


class _Tables:
    """cos and sin as the module computes them, per pair of values read (a base per layer: one pair each), run
    once: (cos [max_length, head_dim], sin) where they read positions only, else ``_Refused``."""

    def __init__(self, positions: ir.Value | None, max_length: int | None):
        self.positions, self.max_length = positions, max_length
        self.evaluated: dict[tuple[str, str], tuple[np.ndarray, np.ndarray] | str] = {}
        self.made: dict[tuple[str, str], tuple[ir.Value, ir.Value]] = {}

    def read(self, rotated: _Rotated) -> tuple[np.ndarray, np.ndarray]:
        key = (rotated.cos.name, rotated.sin.name, rotated.interleaved)
        if key not in self.evaluated:
            try:
                self.evaluated[key] = self._evaluate(rotated)
            except _Refused as exc:
                self.evaluated[key] = str(exc)
        found = self.evaluated[key]
        if isinstance(found, str):
            raise _Refused(found)
        return found

    def initializers(self, graph: ir.Graph, rotated: _Rotated) -> tuple[ir.Value, ir.Value]:
        """The op's cos_cache and sin_cache [max_length, head_dim / 2] for ``rotated``'s tables, registered once."""
        key = (rotated.cos.name, rotated.sin.name, rotated.interleaved)
        if key not in self.made:
            cos, sin = self.read(rotated)
            made = []
            for what, table in (("cos_cache", cos), ("sin_cache", sin)):
                name = f"{_PREFIX}{what}.{len(self.made)}"
                tensor = ir.tensor(np.ascontiguousarray(_pair_columns(table, rotated.interleaved)[0]), name=name)
                value = ir.Value(name=name, const_value=tensor, shape=tensor.shape, type=ir.TensorType(tensor.dtype))
                graph.register_initializer(value)
                made.append(value)
            self.made[key] = (made[0], made[1])
        return self.made[key]

    def _evaluate(self, rotated: _Rotated) -> tuple[np.ndarray, np.ndarray]:
        if self.max_length is None:
            raise _Refused("the file records no max length, which the op's cos/sin tables need")
        if self.positions is None:
            raise _Refused(f"the file takes no {POSITIONS}, which cos/sin would be computed from")
        head_dim = rotated.dim  # the tables' width: the rotated dims
        if rotated.cos.dtype != rotated.x.dtype or rotated.sin.dtype != rotated.x.dtype:
            raise _Refused("its cos/sin are not of the heads' type")
        runner = cut_out([rotated.cos, rotated.sin])
        if runner is None:
            raise _Refused("its cos/sin cannot be cut out of the graph and run (they read an activation?)")
        session, inputs = runner
        read = sorted(value.name for value in inputs)
        if read != [POSITIONS]:
            raise _Refused(f"its cos/sin read {', '.join(read)}, not only {POSITIONS} and constants")
        dtype = self.positions.dtype.numpy()
        whole = np.arange(self.max_length, dtype=dtype)[None]
        cos, sin = (self._rows(value, head_dim, 1, self.max_length)[0] for value in self._run(session, whole))
        # Other rows at other positions must read the same tables at theirs: nothing but each position (not
        # the batch's longest, not the number of tokens) reaches cos/sin.
        mixed = np.stack([np.arange(3, 8), np.array([self.max_length - 1, 0, 2, 1, 4])]).astype(dtype)
        for value, table in zip(self._run(session, mixed), (cos, sin), strict=True):
            if not np.allclose(self._rows(value, head_dim, *mixed.shape), table[mixed], rtol=0, atol=HALVES_ATOL):
                raise _Refused("its cos/sin at a batch of other positions are not the table's rows at them (they "
                               "depend on more than each position)")
        for what, table in (("cos", cos), ("sin", sin)):
            first, second = _pair_columns(table, rotated.interleaved)
            if not np.allclose(first, second, rtol=0, atol=HALVES_ATOL):
                form = "even and odd columns" if rotated.interleaved else "two halves"
                raise _Refused(f"its {what} table's {form} differ (not one angle per rotated pair)")
        return cos, sin

    @staticmethod
    def _run(session, positions: np.ndarray) -> list[np.ndarray]:
        try:
            return session.run(None, {POSITIONS: positions})
        except Exception as error:  # ORT's errors have no common type
            raise _Refused(f"its cos/sin do not run on positions alone: {str(error).splitlines()[0]}") from error

    @staticmethod
    def _rows(value: np.ndarray, head_dim: int, batch: int, seq: int) -> np.ndarray:
        """``value`` [batch, 1, seq, head_dim] (its batch may broadcast) as [batch, seq, head_dim]."""
        if value.ndim != 4 or value.shape[1] != 1 or value.shape[2:] != (seq, head_dim) \
                or value.shape[0] not in (1, batch):
            raise _Refused(f"its cos/sin are {list(value.shape)}, not [batch, 1, seq, {head_dim}]")
        return np.broadcast_to(value[:, 0], (batch, seq, head_dim))


def _pair_columns(table: np.ndarray, interleaved: bool) -> tuple[np.ndarray, np.ndarray]:
    """A [rows, d] table's columns for the first and the second dim of each rotated pair: (i, i + d / 2), or
    (2i, 2i + 1) interleaved. One angle per pair: they are equal, and the first is the op's cache."""
    if interleaved:
        return table[:, 0::2], table[:, 1::2]
    half = table.shape[1] // 2
    return table[:, :half], table[:, half:]


def _merged(graph: ir.Graph, x: ir.Value, hidden: int, name: str) -> ir.Value:
    """``x`` [batch, heads, seq, head_dim] as the op's [batch, seq, hidden]: the projection its heads were split
    from (Reshape, then Transposes that make [batch, heads, seq, d]), else a Reshape of the [batch, seq, heads,
    head_dim] it was transposed from (a norm per head between: Qwen3), else ``x`` transposed and reshaped."""
    value, perm = x, list(range(4))
    while (producer := value.producer()) is not None and producer.op_type == "Transpose":
        step = list(producer.attributes.get_ints("perm", [3, 2, 1, 0]))
        perm = [step[axis] for axis in perm]
        value = producer.inputs[0]
    if perm == [0, 2, 1, 3]:
        if producer is not None and producer.op_type == "Reshape":
            projection = producer.inputs[0]
            if projection.shape is not None and projection.shape.rank() == 3 and projection.shape[2] == hidden:
                return projection
        source = value  # [batch, seq, heads, head_dim]
    else:
        transpose = ir.Node("", "Transpose", [x], [ir.AttrInt64s("perm", [0, 2, 1, 3])],
                            outputs=[ir.Value(name=_PREFIX + name + ".bsnh")], graph=graph,
                            name=_PREFIX + name + ".bsnh")
        source = transpose.outputs[0]
        source.type = x.type
    shape = ir.tensor(np.array([0, 0, hidden], np.int64), name=_PREFIX + name + ".shape")
    shape_value = ir.Value(name=shape.name, const_value=shape, shape=shape.shape, type=ir.TensorType(shape.dtype))
    graph.register_initializer(shape_value)
    merged = ir.Node("", "Reshape", [source, shape_value], outputs=[ir.Value(name=_PREFIX + name + ".merged")],
                     graph=graph, name=_PREFIX + name + ".merged")
    out = merged.outputs[0]
    out.type = x.type
    if x.shape is not None:
        out.shape = ir.Shape([x.shape[0], x.shape[2], hidden])
    return out


def fuse_into_gqa(model: onnx.ModelProto, max_length: int | None,
                  rewrites: Collection[str] | None = None) -> tuple[onnx.ModelProto, list[AttentionRewriteReport]]:
    """A ragged-layout file with each attention's rotary inside its ``GroupQueryAttention`` (``fuse_rotary_into_gqa``),
    then its q/k/v on one packed projection (``fusion.qkv_packing``) and its output's split into heads and merge
    back removed (``fusion.head_round_trip``), in that order; ``rewrites``: the passes to apply, by their names
    (``GQA_REWRITES``; all by default). Returns what each applied pass did (``gqa_notes`` says it)."""
    passes = ((REWRITE, lambda m: fuse_rotary_into_gqa(m, max_length)), (qkv_packing.REWRITE, qkv_packing.pack_qkv),
              (head_round_trip.REWRITE, head_round_trip.drop_head_round_trips))
    reports = []
    for name, rewrite in passes:
        if rewrites is None or name in rewrites:
            model, report = rewrite(model)
            reports.append(report)
    return model, reports


def gqa_notes(reports: list[AttentionRewriteReport]) -> list[str]:
    """One line per pass of ``fuse_into_gqa`` that left an attention as it was, saying why, where the file's
    attentions have a rotary: another model's attention (GPT-2's one projection split three ways) not packed is no
    news."""
    rotary = next((report for report in reports if report.rewrite == REWRITE), None)
    if rotary is None or not rotary.attentions:
        return []
    return [report.summary() for report in reports if report.refused]


def fuse_into_gqa_checked(model: onnx.ModelProto, max_length: int | None,
                          check: Callable[[onnx.ModelProto], ParityReport]
                          ) -> tuple[onnx.ModelProto, ParityReport, list[str]]:
    """``fuse_into_gqa`` kept only as far as ``check`` (parity of a ragged file) passes: one check where the file
    passes with every pass applied. Where it fails, ``model`` (the ragged file without any) is checked; passing, the
    passes that did something are added back one at a time in order, each kept where the file still passes, and one
    note names those left out: the ones that failed, then any that did nothing once an earlier one was left out
    (packing reads the projections the rotary's removal leaves bare). A broken pass costs the file that pass, not
    the ragged layout.

    Returns (the file, its parity report, notes); the report failed only where ``model`` failed too (returned as it
    is, the caller keeping the holes layout)."""
    fused, reports = fuse_into_gqa(model, max_length)
    report = check(fused)
    applied = [found.rewrite for found in reports if found.done]
    if report.passed or not applied:
        return fused, report, gqa_notes(reports)
    why = report.failures[0] if report.failures else report.summary()  # the first call that differed: one line
    best, best_report, best_reports = model, check(model), []
    if not best_report.passed:
        return model, best_report, []
    kept, failed, idle = [], [], []
    for name in applied:
        candidate, tried = fuse_into_gqa(model, max_length, [*kept, name])
        if not next(found for found in tried if found.rewrite == name).done:
            idle.append(name)
            continue
        candidate_report = check(candidate)
        if candidate_report.passed:
            kept.append(name)
            best, best_report, best_reports = candidate, candidate_report, tried
        else:
            failed.append(name)
    notes = gqa_notes(best_reports)
    if failed:
        note = (f"ragged layout without {' nor '.join(failed)}: the file failed parity with "
                f"{'it' if len(failed) == 1 else 'them'} ({why})")
        if idle:
            note += f"; nor {' nor '.join(idle)}, which then applied to no attention"
        notes.append(note)
    return best, best_report, notes
