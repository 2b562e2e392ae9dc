"""A user's causal LM's KV-cache graph (``exporters.own_kv_cache``, narrowed and fused) -> the "ragged" layout:
each attention is contrib ``GroupQueryAttention`` reading and writing the cache in place.

Why: in the "holes" layout each attention's keys are ``Concat(past_key_values.i.key, new keys)``, which is also
``present.i.key``: every step copies the whole cache, and a left-padded row keeps its padding in the cache as
holes that an additive bias (built from the mask by the module's own ops) hides. ``GroupQueryAttention`` takes
each row's length instead (``seqlens_k``), attends over that row's positions only, and writes this call's keys
and values at each row's own positions; bound to the same buffer as its past, present is updated in place.
Measured on the benchmark GPT (tests/user_models/tutorial_gpt.py ``build_bench``), batch 16 greedy on ORT 1.31
CPU: 1.67x the holes file's tokens per second, the same tokens.

The file contract of the ragged layout (what a runtime feeds; ``metadata.cache_layout == CACHE_RAGGED``):

- ``input_ids`` [batch, seq]: each row's next ``seq`` tokens. In a first call (no past), rows may be
  right-padded (pads after each row's tokens); later calls have ``seq`` real tokens per row, and ``seq`` > 1
  only for batch 1 (ONNX Runtime's GroupQueryAttention refuses more tokens after a past on several rows).
- ``attention_mask`` int64 [batch, total]: row r's first n_r entries 1, the rest 0 (n_r = the row's tokens so
  far including this call's real ones). Right padding only.
- ``position_ids`` [batch, seq] (when the file takes them): n_r - seq + arange(seq) (a first call: arange).
- ``past_key_values.i.key|value`` [batch, kv_heads, W, head_dim], W >= each row's past length (n_r - seq): row
  r's first n_r - seq positions are its cache, anything after is ignored. ``present.i.key|value`` [batch,
  kv_heads, max(total, W), head_dim]: past with this call's keys/values written at each row's positions; bound to
  the past's own buffer it is updated in place. ``kv_heads`` is a grouped-query model's KV heads (``kv_num_heads``),
  else every head.

What is rewritten, found structurally: each ``com.microsoft.MultiHeadAttention`` whose keys and values are
``Concat(past input, new [batch, kv_heads, seq, head_dim])`` along the length, each Concat read by the op (directly,
or through a grouped-query model's ``repeat_kv`` of its KV heads, ``fusion.repeat_kv``, and the Reshape(Transpose)
to [batch, total, hidden] upstream's fusion wrote, nothing else reading either) and by one Identity to a present
output. The new keys/values are traced back through Transposes and one Reshape to the [batch, seq, kv_heads *
head_dim] projection GroupQueryAttention takes, or, where they are not one (keys rotated after the heads were
split), transposed and merged into it: the rotary stays the module's own ops, fed by each row's position_ids.
The op's additive bias must come only from
``attention_mask`` and from shapes (a Shape of any input, constants): what the module's mask ops can then
express is key padding and a pattern over positions.
That the pattern is exactly GroupQueryAttention's (key j visible to row r's query at position p iff j < n_r and
j <= p, and j > p - w for a sliding window of w keys, the op's ``local_window_size``; not, say, a chunked mask, nor
a position bias the op would drop) is read from what the bias computes (``check_masks_are_causal``): its subgraph
is cut out (``mask_probe.cut_out``, each Shape it reads fed as the graph's shapes give it on the call) and run on
calls of the contract reaching the longest sequence the file takes (its max length, else ``PROBE_LENGTH``): a first
call of that many tokens with a right-padded row, a chunk mid-way, a one-token step at the end; every bias value
must be 0 or a masking fill, the window is the most keys a query of the whole first row sees (where fewer than the
row), and the keys shown must match key by key. Per-step parity under this layout
(``own_kv_cache.check_own_cache_parity``) then checks the numbers at the lengths it decodes (up to 262 tokens),
which alone would miss a pattern that departs from causal only later. The bias's subgraph, the Concats and the
Identities are then dead and removed. ``to_ragged_cache`` says in one line why it refuses, and the export keeps the
holes layout.

A soft-capped attention (Gemma-2: ``tanh(scores / cap) * cap`` before the mask), which the fusion pipeline leaves
unfused because ``MultiHeadAttention`` cannot cap scores, is first written as one over the same query, keys, values
and mask (``fusion.softcap.as_capped_mha``, in this function's copy of the graph only), then rewritten like the
others with the cap as ``GroupQueryAttention``'s ``softcap``. Refused, the holes file keeps it unfused and exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from mha_deploy.exporters.fusion.contrib_mha import ATTENTION_BIAS, BIAS, KEY_PADDING_MASK, PAST_KEY, optional_input
from mha_deploy.exporters.fusion.mask_probe import MIN_FILL_MAGNITUDE, cut_out
from mha_deploy.exporters.fusion.repeat_kv import repeated_heads
from mha_deploy.exporters.fusion.softcap import as_capped_mha
from mha_deploy.inputs import right_padding_mask

_PREFIX = "ragged."
_DOMAIN = "com.microsoft"
# The longest sequence whose masks are probed where the file records no max length: past the lengths per-step
# parity decodes (260 tokens), where a sliding window or a chunked mask departs from a causal one.
PROBE_LENGTH = 4096


class RaggedRefused(Exception):
    """Why a graph cannot take the ragged layout (one line, for the export's warning)."""


def to_ragged_cache(model: onnx.ModelProto, mask: str = "attention_mask", max_length: int | None = None
                    ) -> onnx.ModelProto:
    """``model`` with every cached attention on ``GroupQueryAttention`` in the ragged layout (the module
    docstring); ``RaggedRefused`` saying why when any one cannot be (``model`` is left as it was).
    ``max_length``: the longest sequence the file takes (the masks are probed up to it; None: ``PROBE_LENGTH``)."""
    ir_model = ir.serde.deserialize_model(model)
    graph = ir_model.graph
    inputs = {value.name: value for value in graph.inputs}
    if mask not in inputs:
        raise RaggedRefused(f"the file takes no {mask}")
    caps = as_capped_mha(graph)
    if caps:  # the soft-capped attentions' old nodes still read their keys and values: gone before they are traced
        RemoveUnusedNodesPass()(ir_model)
    attentions = [node for node in graph if node.op_type == "MultiHeadAttention" and node.domain == _DOMAIN]
    caches = [name for name in inputs if name.startswith("past_key_values.")]
    if not attentions:
        raise RaggedRefused("no attention is fused into contrib MultiHeadAttention (GroupQueryAttention replaces it)")
    plans = [_plan(node, inputs[mask], caps.get(node)) for node in attentions]
    if 2 * len(plans) != len(caches):
        raise RaggedRefused(f"{len(plans)} attention(s) read a cache, the file takes {len(caches)} cache inputs")
    windows = check_masks_are_causal(graph, attentions, inputs[mask], max_length or PROBE_LENGTH)
    lengths, total = _row_lengths(graph, inputs[mask])
    for plan, window in zip(plans, windows or [None] * len(plans), strict=True):
        plan.apply(graph, lengths, total, window)
    RemoveUnusedNodesPass()(ir_model)
    graph.sort()
    return ir.serde.serialize_model(ir_model)


class _Plan:
    """One MultiHeadAttention's rewrite, checked before any is applied."""

    def __init__(self, node, query, keys, values, heads, kv_heads, head_dim, presents, concats, softcap=None):
        self.node, self.query, self.keys, self.values = node, query, keys, values
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.presents, self.concats, self.softcap = presents, concats, softcap

    def apply(self, graph: ir.Graph, lengths: ir.Value, total: ir.Value, window: int | None = None) -> None:
        node = self.node
        attributes = [ir.AttrInt64("num_heads", self.heads), ir.AttrInt64("kv_num_heads", self.kv_heads)]
        if window is not None:  # the op's window: a query sees itself and the window - 1 keys before it
            attributes.append(ir.AttrInt64("local_window_size", window))
        scale = node.attributes.get("scale")
        if scale is not None:
            attributes.append(ir.AttrFloat32("scale", scale.as_float()))
        if self.softcap is not None:  # the op caps the scaled scores of the keys it shows, window or not
            attributes.append(ir.AttrFloat32("softcap", self.softcap))
        past_key, past_value = (concat.inputs[0] for concat in self.concats)
        keys, values = (_projection(graph, new, self.kv_heads * self.head_dim, f"{node.name}.{role}")
                        for new, role in ((self.keys, "keys"), (self.values, "values")))
        outputs = [ir.Value(name=_PREFIX + node.name + ".out"),
                   *(ir.Value(name=_PREFIX + present.name) for present in self.presents)]
        ir.Node(_DOMAIN, "GroupQueryAttention",
                [self.query, keys, values, past_key, past_value, lengths, total],
                attributes, outputs=outputs, name=_PREFIX + node.name, graph=graph)
        out = node.outputs[0]
        outputs[0].shape, outputs[0].type = out.shape, out.type
        out.replace_all_uses_with(outputs[0])
        if out.is_graph_output():
            _swap_output(graph, out, outputs[0])
        # The present outputs were Identity(Concat): GroupQueryAttention now writes them.
        for present, written in zip(self.presents, outputs[1:], strict=True):
            identity = present.producer()
            written.shape, written.type = present.shape, present.type
            _swap_output(graph, present, written)
            name = present.name
            graph.remove(identity, safe=True)
            written.name = name
        graph.remove(node, safe=True)


def _projection(graph: ir.Graph, new: ir.Value, hidden: int, name: str) -> ir.Value:
    """``new`` as GroupQueryAttention takes it, [batch, seq, kv_heads * head_dim]: itself when it is that already
    (the projection the heads were split from), else its [batch, kv_heads, seq, head_dim] transposed and merged
    (keys rotated after the split: a copy of this call's tokens only)."""
    if new.shape is not None and new.shape.rank() == 3:
        return new
    transpose = ir.Node("", "Transpose", [new], [ir.AttrInt64s("perm", [0, 2, 1, 3])],
                        outputs=[ir.Value(name=_PREFIX + name + ".bsnh")], graph=graph, name=_PREFIX + name + ".bsnh")
    shape = ir.tensor(np.array([0, 0, hidden], np.int64), name=_PREFIX + name + ".shape")
    shape_value = ir.Value(name=shape.name, const_value=shape, shape=shape.shape, type=ir.TensorType(shape.dtype))
    graph.register_initializer(shape_value)
    merged = ir.Node("", "Reshape", [transpose.outputs[0], shape_value],
                     outputs=[ir.Value(name=_PREFIX + name + ".merged")], graph=graph, name=_PREFIX + name + ".merged")
    out = merged.outputs[0]
    out.type = new.type
    if new.shape is not None:
        out.shape = ir.Shape([new.shape[0], new.shape[2], hidden])
    return out


def _swap_output(graph: ir.Graph, old: ir.Value, new: ir.Value) -> None:
    index = next(i for i, value in enumerate(graph.outputs) if value is old)
    graph.outputs[index] = new


def _plan(node: ir.Node, mask: ir.Value, softcap: float | None = None) -> _Plan:
    name = node.name or "a MultiHeadAttention"
    if len(node.outputs) != 1 or any(o is not None and o.uses() for o in node.outputs[1:]):
        raise RaggedRefused(f"{name} returns more than its output")
    for index, what in ((BIAS, "a projection bias"), (KEY_PADDING_MASK, "a key padding mask"),
                        (PAST_KEY, "its own past state")):
        if optional_input(node, index) is not None:
            raise RaggedRefused(f"{name} takes {what}")
    heads = node.attributes.get_int("num_heads", 0)
    query = node.inputs[0]
    if query is None or query.shape is None or query.shape.rank() != 3:
        raise RaggedRefused(f"{name}: its query is not [batch, seq, hidden]")
    traced = [_cache_and_new(node, i, heads, name, role) for i, role in ((1, "keys"), (2, "values"))]
    (key_concat, keys, key_dim, key_heads), (value_concat, values, value_dim, value_heads) = traced
    if key_dim != value_dim:
        raise RaggedRefused(f"{name}: keys of {key_dim} and values of {value_dim} per head")
    if key_heads != value_heads:
        raise RaggedRefused(f"{name}: keys of {key_heads} and values of {value_heads} KV heads")
    if key_dim % 8:  # ORT 1.31 CPU refuses it when the op runs ("head_size must be a multiple of 8")
        raise RaggedRefused(f"{name}: a head size of {key_dim}, which GroupQueryAttention takes only in multiples of 8")
    bias = optional_input(node, ATTENTION_BIAS)
    if bias is not None:
        _check_bias_sources(bias, mask, name)
    presents = [_present_of(concat, name) for concat in (key_concat, value_concat)]
    return _Plan(node, query, keys, values, heads, key_heads, key_dim, presents, (key_concat, value_concat), softcap)


def _cache_and_new(node: ir.Node, index: int, heads: int, name: str, role: str
                   ) -> tuple[ir.Node, ir.Value, int, int]:
    """(the Concat growing the cache, its new part as GroupQueryAttention's key or value input will read it, head_dim,
    the KV heads the cache holds) for input ``index`` of ``node``, which reads that cache through no more than:
    the [batch, total, hidden] Reshape(Transpose) upstream's fusion wrote (where the cache's heads were repeated,
    ``fusion.cache_heads`` leaves it), and a grouped-query model's ``repeat_kv`` (``fusion.repeat_kv``). The new
    part is the [batch, seq, kv_heads * head_dim] projection its heads were split from where it is one, else the
    [batch, kv_heads, seq, head_dim] tensor itself (a rotated key), merged when the rewrite applies."""
    value = node.inputs[index]
    path = []  # the values between the cache and the op, read by nothing else (they die with the op)
    merged = value.producer() if value is not None else None
    if merged is not None and merged.op_type == "Reshape" and value.shape is not None and value.shape.rank() == 3:
        split = merged.inputs[0].producer()
        if split is not None and split.op_type == "Transpose" \
                and list(split.attributes.get_ints("perm", [])) == [0, 2, 1, 3]:
            path += [value, split.outputs[0]]
            value = split.inputs[0]
    kv_heads = heads
    repeat = repeated_heads(value)
    if repeat is not None:
        if repeat.kv_heads * repeat.groups != heads:
            raise RaggedRefused(f"{name}: its {role} repeat {repeat.kv_heads} heads {repeat.groups} times, not into "
                                f"its {heads}")
        path += [repeat.repeated, repeat.repeated.producer().inputs[0], repeat.unsqueeze.outputs[0]]
        value, kv_heads = repeat.source, repeat.kv_heads
    if any(len(step.uses()) != 1 or step.is_graph_output() for step in path):
        raise RaggedRefused(f"{name}: the cache its {role} read is read by more than the op")
    concat = value.producer() if value is not None else None
    if concat is None or concat.op_type != "Concat" or concat.attributes.get_int("axis", 0) not in (2, -2) \
            or len(concat.inputs) != 2 or not concat.inputs[0].is_graph_input():
        raise RaggedRefused(f"{name}: its {role} are not a cache input grown by a Concat along the length")
    past = concat.inputs[0]
    shape = past.shape
    if shape is None or shape.rank() != 4 or shape[1] != kv_heads or not isinstance(shape[3], int):
        raise RaggedRefused(f"{name}: {past.name} is not [batch, {kv_heads} heads, past_seq, head_dim]")
    head_dim = shape[3]
    new = concat.inputs[1]
    if new.shape is None or new.shape.rank() != 4 or new.shape[1] != kv_heads or new.shape[3] != head_dim:
        raise RaggedRefused(f"{name}: its new {role} are not [batch, {kv_heads} heads, seq, {head_dim}]")
    return concat, _split_projection(new, kv_heads * head_dim), head_dim, kv_heads


def _split_projection(new: ir.Value, hidden: int) -> ir.Value:
    """The [batch, seq, hidden] projection ``new`` [batch, heads, seq, head_dim] is split from by Transposes and one
    Reshape (that Transposes together make [batch, heads, seq, d]), else ``new`` itself."""
    value, perm = new, list(range(4))
    while (producer := value.producer()) is not None and producer.op_type == "Transpose":
        step = list(producer.attributes.get_ints("perm", [3, 2, 1, 0]))
        perm = [step[axis] for axis in perm]
        value = producer.inputs[0]
    if producer is None or producer.op_type != "Reshape" or perm != [0, 2, 1, 3]:
        return new
    projection = producer.inputs[0]
    shape = projection.shape
    if shape is None or shape.rank() != 3 or shape[2] != hidden:
        return new
    return projection


def _present_of(concat: ir.Node, name: str) -> ir.Value:
    """The present output that is an Identity of the grown cache, which nothing but the attention's path reads
    besides (the op then owns the cache's update)."""
    grown = concat.outputs[0]
    presents = [use.node.outputs[0] for use in grown.uses()
                if use.node.op_type == "Identity" and use.node.outputs[0].is_graph_output()]
    if len(presents) != 1 or grown.is_graph_output() or len(grown.uses()) != 2:
        raise RaggedRefused(f"{name}: its grown cache is read by more than the op and one present output")
    return presents[0]


def _check_bias_sources(bias: ir.Value, mask: ir.Value, name: str) -> None:
    """The additive bias computed from ``mask`` and shapes only: no token, position or cache value reaches it
    (ragged rows differ from padded ones in exactly those)."""
    seen, stack = set(), [bias]
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if value.is_graph_input():
            if value is not mask:
                raise RaggedRefused(f"{name}: its mask reads {value.name}, not only the attention mask and shapes")
            continue
        producer = value.producer()
        if producer is None or producer.op_type == "Shape":
            continue  # an initializer, or a shape (the length of whatever it reads)
        if any(attr.type == ir.AttributeType.GRAPH for attr in producer.attributes.values()):
            raise RaggedRefused(f"{name}: its mask is computed inside a {producer.op_type} subgraph")
        stack.extend(v for v in producer.inputs if v is not None)


@dataclass(frozen=True)
class _Probe:
    """One call of the ragged contract: the cache's width ``past``, ``seq`` tokens, each row's tokens ``lengths``
    after it (its mask's ones, right-aligned padding after them)."""

    what: str
    past: int
    seq: int
    lengths: tuple[int, ...]


def probe_calls(length: int) -> tuple[_Probe, ...]:
    """The calls whose masks are compared at ``length``, the longest sequence: a first call of ``length`` tokens
    (one row whole, one right-padded), a several-token chunk from mid-way (batch 1, as the contract allows it) and
    a one-token step at the end (one row a third shorter)."""
    middle = length // 2
    chunk = max(1, min(16, length - middle))
    return (
        _Probe(f"a first call of {length} tokens", 0, length, (length, max(1, middle))),
        _Probe(f"{chunk} tokens after {middle}", middle, chunk, (middle + chunk,)),
        _Probe(f"a step after {length - 1} tokens", length - 1, 1, (length, max(1, length - length // 3))),
    )


def check_masks_are_causal(graph: ir.Graph, attentions: list[ir.Node], mask: ir.Value, length: int
                           ) -> list[int | None]:
    """Each attention's window (None: causal over the whole past), read from its mask; ``RaggedRefused`` unless
    each mask, its bias as the graph computes it from ``mask`` and shapes (cut out and run,
    ``mask_probe.cut_out``), shows a query exactly the keys ``GroupQueryAttention`` does on every probe call up to
    ``length`` tokens (``probe_calls``): row r's query at position p sees key j iff j < n_r (key padding), j <= p
    (causal) and, for a sliding window of w keys, j > p - w (the op's ``local_window_size`` w). The window is the
    most keys a query of the first call's whole row sees, where that is fewer than the row's length; every call
    must then match it key by key. A bias holding anything but 0 and a masking fill (a learned or ALiBi position
    bias) is refused too: the op would drop it."""
    biases = [optional_input(node, ATTENTION_BIAS) for node in attentions]
    unique = list({id(bias): bias for bias in biases if bias is not None}.values())
    runner = cut_out(unique, shapes_as_inputs=True) if unique else None
    if unique and runner is None:
        raise RaggedRefused("the attentions' mask cannot be cut out of the graph and run, to check it is causal")
    sizes = _symbolic_sizes(graph, mask)
    windows: list[int | None] | None = None
    for call in probe_calls(length):
        values = _run_biases(runner, sizes, mask, call) if runner is not None else {}
        shown = [values.get(bias.name) if bias is not None else None for bias in biases]
        if windows is None:  # the first call: a whole row of ``length`` tokens in row 0
            windows = [_window(bias, node.attributes.get_int("unidirectional", 0), call)
                       for node, bias in zip(attentions, shown, strict=True)]
        for index, (node, bias) in enumerate(zip(attentions, shown, strict=True)):
            reason = _visibility_differs(bias, node.attributes.get_int("unidirectional", 0), call, windows[index])
            if reason:
                raise RaggedRefused(f"the mask of attention {index} {reason} ({call.what}, the mask probe)")
    return windows or [None] * len(attentions)


def _window(bias: np.ndarray | None, unidirectional: int, call: _Probe) -> int | None:
    """The most keys any query of ``call``'s row 0 (a whole row) is shown, where that is fewer than the row holds:
    a sliding window's size; None (causal) otherwise, or where the bias is not one the check would take."""
    if bias is None or bias.ndim < 2 or bias.shape[-1] != call.past + call.seq or bias.shape[-2] != call.seq:
        return None
    rows = bias.reshape((-1, *bias.shape[-2:]))[0]  # row 0 (a broadcast batch: every row's), head 0
    shown = rows == 0
    if unidirectional:
        shown = shown & (np.arange(shown.shape[1])[None] <= call.past + np.arange(call.seq)[:, None])
    widest = int(shown.sum(axis=1).max())
    return widest if 0 < widest < call.lengths[0] else None


def _symbolic_sizes(graph: ir.Graph, mask: ir.Value) -> dict[str, str]:
    """Each symbolic dim of the contract's inputs named by what it measures: "batch", "total", "past", "seq"."""
    named = {}
    roles = {mask.name: ("batch", "total"), "input_ids": ("batch", "seq"), "position_ids": ("batch", "seq")}
    for value in graph.inputs:
        if value.shape is None:
            continue
        role = roles.get(value.name, ("batch", None, "past", None) if value.name.startswith("past_key_values.")
                         else ())
        for dim, what in zip(value.shape, role, strict=False):
            if what is not None and not isinstance(dim, int) and dim.value is not None:
                named[dim.value] = what
    return named


def _run_biases(runner, sizes: dict[str, str], mask: ir.Value, call: _Probe) -> dict[str, np.ndarray]:
    """The biases' values on ``call``'s feeds: the contract's mask, and each Shape the bias reads as the graph's
    shapes say it is on that call (what it reads, an activation say, is not run)."""
    session, inputs = runner
    measures = {"batch": len(call.lengths), "total": call.past + call.seq, "past": call.past, "seq": call.seq}

    def size(value: ir.Value, dim) -> int:
        if isinstance(dim, int):
            return dim
        if dim.value in sizes:
            return measures[sizes[dim.value]]
        raise RaggedRefused(f"the attentions' mask reads the shape of {value.name}, whose dim {dim} the mask "
                            "probe cannot size")

    feeds = {}
    for value in inputs:
        if value is mask:
            feeds[value.name] = right_padding_mask(call.lengths, call.past + call.seq).astype(value.dtype.numpy())
            continue
        shape_of = value.producer()  # every other input of the cut is a Shape's output
        source = shape_of.inputs[0]
        if source.shape is None:
            raise RaggedRefused(f"the attentions' mask reads the shape of {source.name}, which the graph does not "
                                "record")
        start, end = shape_of.attributes.get_int("start", 0), shape_of.attributes.get_int("end", source.shape.rank())
        feeds[value.name] = np.array([size(source, dim) for dim in list(source.shape)[start:end]], np.int64)
    try:
        outputs = session.run(None, feeds)
    except Exception as error:  # ORT's errors have no common type
        raise RaggedRefused(f"the attentions' mask does not run on the probe ({call.what}): "
                            f"{str(error).splitlines()[0]}") from error
    return {output.name: value for output, value in zip(session.get_outputs(), outputs, strict=True)}


def _visibility_differs(bias: np.ndarray | None, unidirectional: int, call: _Probe, window: int | None = None
                        ) -> str | None:
    """How the keys ``bias`` (with the op's own causal flag) shows each real query differ from what
    GroupQueryAttention (with ``local_window_size`` ``window``) shows on ``call``; None when they do not."""
    batch, total = len(call.lengths), call.past + call.seq
    if bias is None:
        bias = np.zeros((1, 1, call.seq, total), np.float32)
    try:
        bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
        bias = np.broadcast_to(bias, (batch, bias.shape[1], call.seq, total))  # [batch, heads, seq, total]
    except ValueError:
        return f"is {list(bias.shape)}, not [batch, heads, {call.seq}, {total}]"
    keys = np.arange(total)
    for row, length in enumerate(call.lengths):
        past = max(length - call.seq, 0)
        if window is not None and past != call.past:
            # The module's mask places this call's queries at the padded batch's last columns, not at a shorter
            # row's own positions: a causal mask is blind to that (the row's keys end before either), a window is
            # not. The op windows each row at its own positions, which is what the module computes for the row
            # alone: the rows whose positions are the columns (every row of a first call, the longest row of a
            # later one, and batch 1) show it; per-step parity checks the shorter rows' numbers.
            continue
        queries = np.arange(length - past)  # the row's real queries (a first call's padding after them)
        values = bias[row, :, : len(queries)]  # [heads, real queries, total]
        masked, shown = (values <= -MIN_FILL_MAGNITUDE) | np.isneginf(values), values == 0
        if not (masked | shown).all():
            odd = values[~(masked | shown)][0]
            return (f"adds {odd:g} to a score, neither 0 nor a masking fill (a position bias?), which "
                    "GroupQueryAttention would drop")
        if unidirectional:  # the op's own flag: causal by column, the queries the last of the keys
            shown = shown & (keys[None, None] <= call.past + queries[None, :, None])
        wanted = (keys[None, :] < length) & (keys[None, :] <= past + queries[:, None])
        if window is not None:
            wanted &= keys[None, :] > past + queries[:, None] - window
        differs = np.argwhere(shown != wanted[None])
        if len(differs):
            _, query, key = differs[0]
            position = past + query
            where = "" if batch == 1 else f" in row {row}"
            expected = "a causal mask" if window is None else f"a sliding window of {window} keys"
            if wanted[query, key]:
                return (f"hides key {key} from query {position}{where}{' (a window?)' if key < position else ''} "
                        f"where {expected} shows it")
            return f"shows key {key} to query {position}{where} where {expected} with key padding hides it"
    return None


def _row_lengths(graph: ir.Graph, mask: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(seqlens_k int32 [batch]: each row's real tokens minus one, total_sequence_length int32 scalar: the
    mask's width), computed once for every attention."""
    def constant(name, array):
        tensor = ir.tensor(np.asarray(array), name=_PREFIX + name)
        value = ir.Value(name=_PREFIX + name, const_value=tensor, shape=tensor.shape, type=ir.TensorType(tensor.dtype))
        graph.register_initializer(value)
        return value

    def node(op, inputs, out, **attributes):
        made = ir.Node("", op, inputs, [ir.AttrInt64(k, v) if isinstance(v, int) else ir.AttrInt64s(k, v)
                                        for k, v in attributes.items()],
                       outputs=[ir.Value(name=_PREFIX + out)], graph=graph, name=_PREFIX + out)
        return made.outputs[0]

    as_int64 = node("Cast", [mask], "mask", to=ir.DataType.INT64.value)
    count = node("ReduceSum", [as_int64, constant("axis1", np.array([1], np.int64))], "count", keepdims=0)
    last = node("Sub", [count, constant("one", np.array(1, np.int64))], "last")
    lengths = node("Cast", [last], "seqlens_k", to=ir.DataType.INT32.value)
    width = node("Shape", [mask], "width64", start=1, end=2)
    width32 = node("Cast", [width], "width32", to=ir.DataType.INT32.value)
    total = node("Squeeze", [width32, constant("axis0", np.array([0], np.int64))], "total_sequence_length")
    return lengths, total
