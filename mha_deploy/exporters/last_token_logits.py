"""A KV-cache causal LM's LM head run for one token per row: the row's last real token of the call
(``export --kv-cache --logits last``). The logits output becomes [batch, 1, vocab].

Why: a generator reads the logits of each row's last token only, yet the exported graph runs the LM head (the
[hidden, vocab] MatMul) on every position of the call. At a prompt that is the largest MatMul of the model times
the prompt's length: on the benchmark Llama (hidden 512, vocabulary 32k, 6 layers) about half of a prefill's
FLOPs, and the logits of a batch of 16 prompts of 1024 tokens are 2 GB of fp32 that nobody reads.

What is rewritten, in one place (``logits_at_last_token``): the LM head is found walking back from the logits
output through ops that act on each position alone (a bias, a cast, Gemma-2's final soft-cap), to the MatMul with
a constant weight (computed from initializers alone: a tied head's is the token table through a Transpose;
MatMulNBits once quantized) whose data input is the hidden states [batch, seq, hidden]. Where the final norm
produces them per token (``_FINAL_NORMS`` over the last axis, its other outputs unread: a Skip norm's residual sum
included) and nothing but the head reads its output, each row's last real token of the call is gathered from the
norm's inputs (a Skip norm's input and skip alike), so that the norm too runs on one token per row; else from the
hidden states, right before the head. Everything from there to the output then runs on [batch, 1, ...].

Which position is a row's last real token comes from the graph's own inputs, so that it holds for every call a
runtime makes under either cache layout: the last 1 of ``attention_mask``'s last ``seq`` columns (the mask covers
past + this call, 1 = real). Holes layout: those columns are this call's (a left- or right-padded prompt, then
steps of real tokens). Ragged layout (``fusion.ragged_cache``): a first call's mask is [batch, seq] with each row's
tokens first (right padding), later calls have ``seq`` real tokens per row, the row's last ``seq`` mask columns all
1 for batch 1 and the one column a step reads otherwise. A row with no real token in the call (padding only, which
no runtime sends) gets its last column. A file that takes no mask: the last column.

``logits_at_every_position`` undoes it (the graph as it was before), for what needs every position's logits at
export (``--eval-data``'s perplexity over a prompt).
"""

from __future__ import annotations

from dataclasses import replace

import onnx
from onnx import TensorProto, helper

from mha_deploy.errors import ExportError
from mha_deploy.onnx_nodes import producers_and_readers
from mha_deploy.signature import LAST_TOKEN, Signature

PREFIX = "last_token_logits/"
LOGITS, INPUT_IDS, ATTENTION_MASK = "logits", "input_ids", "attention_mask"
LOGITS_CHOICES = ("auto", "last", "all")
LOGITS_ALL_HINT = "export with --logits all (every position's logits, [batch, seq, vocab])"
# The LM head: a MatMul with a constant weight, or its weight-only quantized form.
_HEADS = {("", "MatMul"), ("", "Gemm"), ("com.microsoft", "MatMulNBits")}
# Ops between the LM head and the logits output that act on each position alone (their other operands constants):
# a bias, a cast, a scale, Gemma-2's final soft-cap (tanh(x / cap) * cap).
_PER_POSITION = {"Identity", "Cast", "Add", "Sub", "Mul", "Div", "Tanh"}
_INT64_MAX = 2**63 - 1
# Final norms that act on each position alone, over the last axis: (domain, op) -> the inputs read per position (the
# rest are scales and biases over the hidden axis). The Skip norms also write the residual sum (output 3): they move
# only where nothing reads it.
_FINAL_NORMS = {
    ("", "LayerNormalization"): 1, ("", "SimplifiedLayerNormalization"): 1, ("", "RMSNormalization"): 1,
    ("com.microsoft", "SkipLayerNormalization"): 2, ("com.microsoft", "SkipSimplifiedLayerNormalization"): 2,
}
# Ops whose output is not fixed by their inputs alone.
_NOT_CONSTANT = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}


def logits_at_last_token(model: onnx.ModelProto, output: str = LOGITS) -> onnx.ModelProto:
    """``model`` with its ``output`` computed at each row's last real token of the call only: [batch, 1, vocab].
    Raises ``ExportError`` (naming ``--logits all``) when the LM head is not found as the module description says."""
    if any(node.name == _gather(0) for node in model.graph.node):
        return model  # already rewritten
    model_copy = onnx.ModelProto()
    model_copy.CopyFrom(model)
    graph = model_copy.graph
    head, hidden = _lm_head(graph, output)
    inputs = {value.name for value in graph.input}
    norm = _final_norm(graph, head, hidden)
    # What is gathered, and the node before which the gather goes (what it reads is produced before that node).
    if norm is not None:
        targets, before = [(name, norm) for name in norm.input[:_FINAL_NORMS[(norm.domain, norm.op_type)]]], norm
    else:
        targets, before = [(hidden, head)], head

    def name(part: str) -> str:
        return PREFIX + part

    def constant(part: str, values: list[int]) -> onnx.NodeProto:
        tensor = helper.make_tensor(name(part), TensorProto.INT64, [len(values)], values)
        return helper.make_node("Constant", [], [name(part)], value=tensor, name=name(part))

    if ATTENTION_MASK in inputs and INPUT_IDS in inputs:
        nodes = [
            # This call's columns of the mask over past + seq: the last seq.
            helper.make_node("Shape", [INPUT_IDS], [name("seq")], start=1, end=2, name=name("seq")),
            helper.make_node("Neg", [name("seq")], [name("minus_seq")], name=name("minus_seq")),
            constant("end", [_INT64_MAX]),
            constant("axis", [1]),
            helper.make_node("Slice", [ATTENTION_MASK, name("minus_seq"), name("end"), name("axis")],
                             [name("call_mask")], name=name("call_mask")),
            # ArgMax takes numbers (a bool mask too, cast); the last 1 of a row wins (select_last_index).
            helper.make_node("Cast", [name("call_mask")], [name("real")], to=TensorProto.FLOAT, name=name("real")),
            helper.make_node("ArgMax", [name("real")], [name("last")], axis=1, keepdims=1, select_last_index=1,
                             name=name("last")),  # [batch, 1]
            constant("axis_2", [2]),
            helper.make_node("Unsqueeze", [name("last"), name("axis_2")], [name("index")],
                             name=name("index")),  # [batch, 1, 1]
        ]
        # Per row, its position along the sequence axis: [batch, 1, hidden]. GatherND over the batch axis takes the
        # index as ArgMax gives it; GatherElements needed it expanded over the hidden axis first (three more
        # nodes a decode step, each a few us of a batch-1 step).
        for index, (value, _) in enumerate(targets):
            nodes.append(helper.make_node("GatherND", [value, name("index")], [_picked(index)], batch_dims=1,
                                          name=_gather(index)))
    else:  # every column is a real token: the last one
        nodes = [
            constant("start", [-1]),
            constant("end", [_INT64_MAX]),
            constant("axis", [1]),
        ]
        for index, (value, _) in enumerate(targets):
            nodes.append(helper.make_node("Slice", [value, name("start"), name("end"), name("axis")],
                                          [_picked(index)], name=_gather(index)))
    for index, (value, reader) in enumerate(targets):
        reader.input[:] = [_picked(index) if read == value else read for read in reader.input]
    # Right before the norm or the head: what they read (the graph's inputs, the gathered values) is produced
    # before it.
    position = list(graph.node).index(before)
    for offset, node in enumerate(nodes):
        graph.node.insert(position + offset, node)
    for value in graph.output:
        if value.name == output and value.type.tensor_type.HasField("shape"):
            dims = value.type.tensor_type.shape.dim
            if len(dims) >= 2:
                dims[1].Clear()
                dims[1].dim_value = 1
    return model_copy


def last_token_signature(signature: Signature, output: str = LOGITS) -> Signature:
    """A causal LM's cache ``signature`` with ``output`` [batch, 1, vocab] at each row's last real token of the call
    (role ``LAST_TOKEN``)."""
    outputs = tuple(replace(spec, role=LAST_TOKEN, axes=(spec.axes[0], 1, *spec.axes[2:])) if spec.name == output
                    else spec for spec in signature.custom_outputs)
    return replace(signature, custom_outputs=outputs)


def logits_at_every_position(model: onnx.ModelProto, output: str = LOGITS, seq_axis: str = "seq") -> onnx.ModelProto:
    """``model`` as it was before ``logits_at_last_token``: the LM head on every position, ``output`` [batch,
    ``seq_axis``, vocab]. ``model`` itself when it was not rewritten."""
    if not any(node.name == _gather(0) for node in model.graph.node):
        return model
    model_copy = onnx.ModelProto()
    model_copy.CopyFrom(model)
    graph = model_copy.graph
    # each gathered value back to what it was gathered from (the hidden states, or the final norm's inputs)
    gathered = {node.output[0]: node.input[0] for node in graph.node if node.name.startswith(PREFIX + "gather")}
    kept = [node for node in graph.node if not node.name.startswith(PREFIX)]
    for node in kept:
        node.input[:] = [gathered.get(value, value) for value in node.input]
    del graph.node[:]
    graph.node.extend(kept)
    for value in graph.output:
        if value.name == output and value.type.tensor_type.HasField("shape"):
            dims = value.type.tensor_type.shape.dim
            if len(dims) >= 2:
                dims[1].Clear()
                dims[1].dim_param = seq_axis
    return model_copy


def lm_head_refusal(model: onnx.ModelProto, output: str = LOGITS) -> str | None:
    """Why ``logits_at_last_token`` cannot rewrite ``model`` (one line), or None when it can: what ``--logits auto``
    asks before choosing it."""
    found = _find_lm_head(model.graph, output)
    return found if isinstance(found, str) else None


def _lm_head(graph: onnx.GraphProto, output: str) -> tuple[onnx.NodeProto, str]:
    """The LM head node producing ``output`` and its data input (the hidden states)."""
    found = _find_lm_head(graph, output)
    if isinstance(found, str):
        raise ExportError(f"--logits last: {found}; {LOGITS_ALL_HINT}")
    return found


def _picked(index: int) -> str:
    """The value gathered from the ``index``-th input of the final norm (0: its input, 1: a Skip norm's skip), or
    from the hidden states where no norm moves (0)."""
    return PREFIX + ("hidden", "skip")[index]


def _gather(index: int) -> str:
    return PREFIX + ("gather", "gather_skip")[index]


def _final_norm(graph: onnx.GraphProto, head: onnx.NodeProto, hidden: str) -> onnx.NodeProto | None:
    """The per-token norm producing ``hidden`` that can run after the gather instead of before it: over the last
    axis, only the head reading what it writes (its other outputs unread: a Skip norm's residual sum would be read at
    every position), its per-position inputs of one known rank-3 shape (a Skip norm's skip broadcast over the batch
    would not gather along with its input). None where there is none."""
    producer, readers = producers_and_readers(graph)
    norm = producer.get(hidden)
    if norm is None or (norm.domain, norm.op_type) not in _FINAL_NORMS or norm.output[0] != hidden:
        return None
    outputs = {value.name for value in graph.output}
    if hidden in outputs or readers.get(hidden, []) != [head] or any(
            name and (name in outputs or readers.get(name)) for name in norm.output[1:]):
        return None
    shapes = {value.name: [dim.dim_param or (dim.dim_value if dim.HasField("dim_value") else None)
                           for dim in value.type.tensor_type.shape.dim]
              for value in (*graph.input, *graph.value_info) if value.type.tensor_type.HasField("shape")}
    read = [shapes.get(name) for name in norm.input[:_FINAL_NORMS[(norm.domain, norm.op_type)]]]
    if any(shape is None or len(shape) != 3 or None in shape[:2] or shape != read[0] for shape in read):
        return None
    axis = next((attribute.i for attribute in norm.attribute if attribute.name == "axis"), -1)
    return norm if axis in (-1, 2) else None


def _find_lm_head(graph: onnx.GraphProto, output: str) -> tuple[onnx.NodeProto, str] | str:
    """``_lm_head``'s node and hidden states, or why there is none."""
    producer, readers = producers_and_readers(graph)
    # Values computed from weights alone: a tied head's weight is the token table through a Transpose.
    constants = {tensor.name for tensor in graph.initializer}
    for node in graph.node:
        if all(value in constants for value in node.input if value) and node.op_type not in _NOT_CONSTANT:
            constants.update(node.output)
    if output not in {value.name for value in graph.output}:
        return f"the file has no {output} output"
    name, seen = output, []
    while True:
        node = producer.get(name)
        if node is None or (name != output and len(readers.get(name, [])) > 1):
            break  # a graph input, or a value something else reads at every position
        seen.append(node.op_type)
        if (node.domain, node.op_type) in _HEADS and len(node.input) > 1 and node.input[1] in constants:
            if node.op_type == "Gemm":
                break  # a 2-D product: the positions are not an axis of its own to gather along
            return node, node.input[0]
        data = [value for value in node.input if value and value not in constants]
        if node.op_type not in _PER_POSITION or len(data) != 1:
            break
        name = data[0]
    return (f"no LM head found behind {output} (a MatMul with a constant weight reached through per-token ops; "
            f"walked through {' <- '.join(seen) or 'nothing'})")
