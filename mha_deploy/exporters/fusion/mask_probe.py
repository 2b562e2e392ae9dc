"""What an attention bias computes, read by running its subgraph on probe inputs.

``mask_analysis``'s algebra reads a mask from the ops that build it, exactly, but
only the ops it knows: the reference's ``masked_fill``, torch's own masks. Users'
libraries build the same masks other ways: Hugging Face's mask functions index
the padding input with ``GatherND`` over [batch, kv] index grids and combine
predicates on query and key positions (``kv_idx <= q_idx``, ``kv_idx >= 0``),
then turn the result into ``where(mask, 0, finfo.min)``, ``(1 - mask) * fill``
or a bool mask whose fully masked rows are unmasked again. A list of spellings
would never be complete, so this module asks the other question: what does the
bias hold? Its subgraph (the nodes from the graph's inputs to the bias) is cut
out and run in ONNX Runtime on a few probe feeds, each padding input patterned
(right-, left-padded, holes, whole rows real) at several lengths, every other
input random; the result is compared with what "key padding of input P",
"causal" and both would give.

Why this is sound enough to drop the bias for the op's own mask inputs:

- a padding input of the exported file is bool, so the probes cover its value
  domain; the op reads any nonzero value as a real token, so integer inputs are
  probed with 1, 2 and 3 (an integer ``&`` gives 2 & 1 = 0) and float inputs
  with 1, 0.5 and 2 (a cast to an integer type truncates 0.5 to padding);
- only rows with a visible key are compared: a row with none is a padded query
  under left padding + causal, or an all-padding item (padding, never returned;
  Hugging Face's sdpa masks unmask them), where the kernels differ anyway (a
  mask that also hides padded queries' rows, DeBERTa's, is not key padding: a
  model may read a padded position's output, its first token's under left padding);
- every other input is drawn afresh per probe, so a bias that also depends on
  them (token ids, activations) matches no candidate;
- what probes at these lengths cannot see is a pattern that changes only at
  longer ones (a sliding window, chunks): a mask whose integer arithmetic uses
  a constant other than 0 and +-1 (a window or chunk size) is not read by probes;
- and every export checks the fused file against the module at unseen lengths.

A bias made of several terms (``scores + position_bias + mask``, T5) is read
term by term: terms that mask nothing (finite, above any masking fill) are a
real bias kept as the op's ``attention_bias``; the masking terms together must
be key padding and/or causal; all-zero terms (T5's cross-attention bias) go. A bias all of whose terms are
zero (a mask that masks nothing: ViT's) goes whole, unless its integer arithmetic holds a window or chunk size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir

# Anything at least this negative is a masking fill: exp of it underflows to 0 in every float type.
MIN_FILL_MAGNITUDE = 1e4
# A bias whose subgraph is larger, or reads a model's activations, is not a mask built from the inputs.
MAX_NODES = 400
_ACTIVATION_OPS = {"MatMul", "Gemm", "Conv", "Softmax", "LayerNormalization", "Attention", "MultiHeadAttention"}
# Integer arithmetic whose constants other than 0 and +-1 may be a window or a chunk size.
_POSITION_ARITHMETIC = {"Add", "Sub", "Mul", "Div", "Mod", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Equal"}
_INTEGER_TYPES = {getattr(ir.DataType, f"{sign}INT{bits}") for sign in ("", "U") for bits in (8, 16, 32, 64)}
# (batch, key length): the probe feeds; a query length other than the key length is the key length + 2.
PROBE_SIZES = ((4, 6), (5, 9), (2, 40))
MAX_TERMS = 8


@dataclass(frozen=True)
class ProbedBias:
    """What a bias was found to hold."""

    fill: float
    key_padding: ir.Value | None  # a graph input [batch, kv_len], None when no key is padded
    padding_marks_real: bool
    causal: bool
    # The terms that mask nothing (a position bias), to keep as the op's attention_bias.
    bias_terms: tuple[ir.Value, ...] = ()


class _NotReadable(Exception):
    """The bias cannot be cut out and run, or holds something other than a mask plus a bias."""


def probe_bias(bias: ir.Value, dims: tuple) -> ProbedBias | None:
    """Read ``bias`` (float, broadcasting to [batch, heads, q_len, kv_len]) by running it; None when it is
    not key padding and/or causal plus terms that mask nothing.

    ``dims``: the op's (batch, q_len, kv_len) (ints or symbolic dims). The key padding can be any graph
    input [batch, kv_len] the bias reads; causal only when q_len is kv_len."""
    try:
        return _probe(bias, dims)
    except _NotReadable:
        return None


def reads_activations(value: ir.Value) -> bool:
    """Whether ``value`` is computed from the model's activations (a MatMul, a normalisation, ... on its way from
    the graph's inputs): a score term such as DeBERTa's c2p + p2c, never a mask built from the inputs."""
    stack, seen = [value], set()
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        node = current.producer()
        if node is None or node.op_type in ("Shape", "Size"):  # an activation's shape is not its values
            continue
        if node.op_type in _ACTIVATION_OPS:
            return True
        stack.extend(node.inputs)
    return False


def window_constants(value: ir.Value) -> bool:
    """Whether the mask ``value`` is built from the inputs alone with integer arithmetic on a constant other than 0
    and +-1: a sliding window or a chunk size (ModernBERT's local layers), which no probe length can bound."""
    try:
        nodes, _ = _subgraph([value], shapes_as_inputs=True)  # the Expand upstream adds reads the query's shape
    except _NotReadable:
        return False
    # A comparison of positions against a size: ``|q - k| <= w`` (ModernBERT), ``k > q - w``. Shape arithmetic
    # (a view's batch * heads) compares nothing.
    for node in nodes:
        if node.op_type not in _COMPARISONS:
            continue
        for operand in node.inputs:
            producer = operand.producer() if operand is not None else None
            sources = [operand, *(producer.inputs if producer is not None and producer.op_type in ("Add", "Sub")
                                  else ())]
            if any(_sized_constant(source) for source in sources):
                return True
    return False


_COMPARISONS = {"Less", "LessOrEqual", "Greater", "GreaterOrEqual"}


def _sized_constant(value: ir.Value | None) -> bool:
    """Whether ``value`` is an integer constant other than 0 and +-1."""
    if value is None or value.dtype not in _INTEGER_TYPES:
        return False
    tensor = value.const_value
    if tensor is None and (producer := value.producer()) is not None and producer.op_type == "Constant":
        tensor = producer.attributes.get_tensor("value", None)
    return tensor is not None and not np.isin(tensor.numpy(), (-1, 0, 1)).all()


def cut_out(outputs: list[ir.Value], shapes_as_inputs: bool = False):
    """(an ONNX Runtime session computing ``outputs`` from the graph inputs they read, those inputs): the
    subgraph producing them cut out of their graph, as ``probe_bias`` runs it; None when it cannot be (an
    activation or a control-flow op on the way, an untyped value, a graph ORT cannot run alone).
    ``shapes_as_inputs``: each Shape's output is an input of the cut instead (whatever the Shape reads, an
    activation included, stays out), for a caller that knows the shapes to feed."""
    try:
        nodes, inputs = _subgraph(outputs, shapes_as_inputs)
        return _session(_model(nodes, inputs, outputs)), inputs
    except _NotReadable:
        return None


def _probe(bias: ir.Value, dims: tuple) -> ProbedBias:
    terms = _terms(bias)
    if not terms or len(terms) > MAX_TERMS:
        raise _NotReadable
    outputs = list({term.value.name: term.value for term in terms}.values())
    nodes, inputs = _subgraph(outputs)
    candidates = [
        value
        for value in inputs
        if value.shape is not None and value.shape.rank() == 2 and tuple(value.shape) == (dims[0], dims[2])
    ]
    session = _session(_model(nodes, inputs, outputs))
    same_length = dims[1] == dims[2]
    runs = [_run(session, inputs, outputs, candidates, dims, size, seed) for seed, size in enumerate(PROBE_SIZES)]
    values = [[term.evaluate(run[1]) for term in terms] for run in runs]  # [probe][term]
    if not all(_spans_lengths(value, run[2]) for probe, run in zip(values, runs, strict=True) for value in probe):
        raise _NotReadable  # the feeds did not set its lengths consistently (a cache model's rows cut by past)
    kinds = [_term_kind([probe[i] for probe in values]) for i in range(len(terms))]
    for index, kind in enumerate(kinds):
        # Kept as the op's attention_bias, which broadcasts batch and heads but not q and kv.
        if kind == "bias" and any(
            probe[index].ndim != 4 or probe[index].shape[-2:] != run[2] for probe, run in zip(values, runs, strict=True)
        ):
            raise _NotReadable
    bias_terms = tuple(term.value for term, kind in zip(terms, kinds, strict=True) if kind == "bias")
    masks = [i for i, kind in enumerate(kinds) if kind == "mask"]
    if not masks:
        # Every term 0 at every probe masks nothing (ViT's all-True mask expanded over the batch): the op needs
        # no bias, unless a window or chunk size may mask at lengths the probes did not reach.
        if not bias_terms and _has_position_constants(nodes):
            raise _NotReadable
        return ProbedBias(0.0, None, True, False, bias_terms)
    if _has_position_constants(_subgraph([terms[i].value for i in masks])[0]):
        raise _NotReadable
    mask_sums = [sum(probe[i] for i in masks) for probe in values]
    fill = max(float(np.max(total[total <= -MIN_FILL_MAGNITUDE])) for total in mask_sums
               if (total <= -MIN_FILL_MAGNITUDE).any())
    for candidate in [None, *candidates]:
        for marks_real in (True, False) if candidate is not None else (True,):
            for causal in (False, True) if same_length else (False,):
                if candidate is None and not causal:
                    continue
                if all(_matches(total, run[0], candidate, marks_real, causal, run[2]) for total, run in
                       zip(mask_sums, runs, strict=True)):
                    return ProbedBias(fill, candidate, marks_real, causal, bias_terms)
    raise _NotReadable


@dataclass(frozen=True)
class _Term:
    """A summand of the bias: ``value`` itself, or with ``fill`` the mask part of ``Where(value, x, fill)``
    (``keeps``: True) or ``Where(value, fill, x)`` (False), whose ``x`` is a term of its own."""

    value: ir.Value
    fill: float | None = None
    keeps: bool = True

    def evaluate(self, outputs: dict[str, np.ndarray]) -> np.ndarray:
        value = outputs[self.value.name]
        if self.fill is None:
            return value
        hidden = value == 0 if self.keeps else value != 0
        return np.where(hidden, self.fill, 0.0)


def _terms(bias: ir.Value) -> list[_Term]:
    """The summands of ``bias``: an Add tree flattened, looking through an Expand on top (the op broadcasts
    batch and heads itself; the terms kept are checked explicit on q and kv). ``Where(c, x, FILL)`` (a
    ``masked_fill`` of a bias, T5 with sdpa) is ``x + Where(c, 0, FILL)``: where c masks, the fill swamps x."""
    if _scalar(bias) == 0:  # zeros_like: T5's cross-attention "position bias"
        return []
    node = bias.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return [_Term(bias)]
    if node.op_type == "Expand":
        return _terms(node.inputs[0])
    if node.op_type == "Add":
        return [term for operand in node.inputs for term in _terms(operand)]
    if node.op_type == "Where":
        condition, when_true, when_false = node.inputs
        for fill, other, keeps in ((when_false, when_true, True), (when_true, when_false, False)):
            constant = _scalar(fill)
            if constant is not None and constant <= -MIN_FILL_MAGNITUDE and _scalar(other) is None:
                return [*_terms(other), _Term(condition, constant, keeps)]
    return [_Term(bias)]


def _scalar(value: ir.Value) -> float | None:
    tensor = value.const_value
    if tensor is None and (producer := value.producer()) is not None and producer.op_type == "Constant":
        tensor = producer.attributes.get_tensor("value", None)
    if tensor is None:
        return None
    array = tensor.numpy()
    return float(array.reshape(-1)[0]) if array.size == 1 else None


def _subgraph(outputs: list[ir.Value], shapes_as_inputs: bool = False) -> tuple[list[ir.Node], list[ir.Value]]:
    """The nodes computing ``outputs`` from the graph's inputs and constants (and Shapes' outputs, with
    ``shapes_as_inputs``), in graph order; the inputs read."""
    producer = next((value.producer() for value in outputs if value.producer() is not None), None)
    if producer is None or producer.graph is None:
        raise _NotReadable
    graph = producer.graph
    nodes: set[ir.Node] = set()
    inputs: dict[str, ir.Value] = {}
    stack, seen = list(outputs), set()
    while stack:
        value = stack.pop()
        if value is None or id(value) in seen:
            continue
        seen.add(id(value))
        if not value.name:
            raise _NotReadable
        if value.is_graph_input() or (shapes_as_inputs and value.producer() is not None
                                      and value.producer().op_type == "Shape"):
            inputs[value.name] = value
            continue
        if value.const_value is not None and value.producer() is None:
            continue
        node = value.producer()
        if node is None or node.graph is not graph or node.op_type in _ACTIVATION_OPS:
            raise _NotReadable
        if any(attribute.type == ir.AttributeType.GRAPH for attribute in node.attributes.values()):
            raise _NotReadable
        nodes.add(node)
        if len(nodes) > MAX_NODES:
            raise _NotReadable
        stack.extend(node.inputs)
    return [node for node in graph if node in nodes], list(inputs.values())


def _has_position_constants(nodes: list[ir.Node]) -> bool:
    """Whether integer arithmetic in ``nodes`` reads a constant other than 0 and +-1 (a window, a chunk size)."""
    for node in nodes:
        if node.op_type not in _POSITION_ARITHMETIC:
            continue
        for value in node.inputs:
            if value is None or value.dtype not in _INTEGER_TYPES:
                continue
            tensor = value.const_value
            if tensor is None and (producer := value.producer()) is not None and producer.op_type == "Constant":
                tensor = producer.attributes.get_tensor("value", None)
            if tensor is not None and not np.isin(tensor.numpy(), (-1, 0, 1)).all():
                return True
    return False


def _model(nodes: list[ir.Node], inputs: list[ir.Value], outputs: list[ir.Value]) -> onnx.ModelProto:
    """The standalone model computing ``outputs`` from ``inputs`` (each input and output typed)."""
    if not nodes or any(v.dtype is None for v in (*inputs, *outputs)) or any(v.shape is None for v in inputs):
        raise _NotReadable
    graph = nodes[0].graph
    initializers, seen = [], set()
    for node in nodes:
        for value in node.inputs:
            if value is not None and value.const_value is not None and value.producer() is None \
                    and not value.is_graph_input() and value.name not in seen:
                seen.add(value.name)
                tensor = ir.serde.serialize_tensor(value.const_value)
                tensor.name = value.name
                initializers.append(tensor)
    proto = onnx.helper.make_graph(
        [ir.serde.serialize_node(node) for node in nodes],
        "probe",
        [onnx.helper.make_tensor_value_info(v.name, v.dtype.value, [None] * v.shape.rank()) for v in inputs],
        [onnx.helper.make_tensor_value_info(v.name, v.dtype.value, None) for v in outputs],
        initializers,
    )
    opsets = [onnx.helper.make_opsetid(domain, version) for domain, version in graph.opset_imports.items()]
    model = onnx.helper.make_model(proto, opset_imports=opsets)
    model.ir_version = 10
    return model


def _session(model: onnx.ModelProto):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    # Fatal only: a probe ORT cannot run (feeds of lengths a narrowed cache graph does not take together) is
    # simply not read, and its error in the export's output would look like the export's failure.
    options.log_severity_level = 4
    try:
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as error:  # a graph ORT cannot run alone is simply not read
        raise _NotReadable from error


def _run(session, inputs, outputs, candidates, dims, size, seed):
    """(the feeds by name, the outputs' values by name, (q_len, kv_len)) for one probe size."""
    batch, kv = (dim if isinstance(dim, int) else probe for dim, probe in zip((dims[0], dims[2]), size, strict=True))
    q = dims[1] if isinstance(dims[1], int) else kv if dims[1] == dims[2] else kv + 2
    rng = np.random.default_rng(seed)
    sizes = {_dim_key(dims[0]): batch, _dim_key(dims[2]): kv, _dim_key(dims[1]): q}
    feeds = {}
    for value in inputs:
        if value.shape is None or value.dtype is None:
            raise _NotReadable
        shape = []
        for dim in value.shape:
            if isinstance(dim, int):
                shape.append(dim)
            elif dim.value is None:
                raise _NotReadable
            else:
                # Any other length: one the op's are not.
                shape.append(sizes.setdefault(dim.value, kv + 1 + len(sizes)))
        feeds[value.name] = _feed(value, shape, rng, any(value is c for c in candidates))
    try:
        values = session.run([value.name for value in outputs], feeds)
    except Exception as error:
        raise _NotReadable from error
    by_name = {value.name: np.asarray(v, dtype=np.float64) for value, v in zip(outputs, values, strict=True)}
    return feeds, by_name, (q, kv)


def _spans_lengths(value: np.ndarray, lengths: tuple[int, int]) -> bool:
    """Whether a term spans the op's (q_len, kv_len) or broadcasts along them, and holds something."""
    trailing = value.shape[-2:]
    expected = lengths[2 - len(trailing):]
    return value.size > 0 and all(dim in (1, length) for dim, length in zip(trailing, expected, strict=True))


def _dim_key(dim) -> object:
    """An op's dim as the probe sizes are keyed: an int, or a symbolic dim's name."""
    return dim if isinstance(dim, int) or dim is None else dim.value


def _feed(value: ir.Value, shape: list[int], rng, is_candidate: bool) -> np.ndarray:
    dtype = value.dtype.numpy()
    if is_candidate:
        real = _padding_pattern(shape[0], shape[1], rng)
        if value.dtype == ir.DataType.BOOL:
            return real
        # The op reads any nonzero value as a real token: so must the mask (2 & 1 is 0; a cast of 0.5 to int, 0).
        real_values = (1.0, 0.5, 2.0) if value.dtype not in _INTEGER_TYPES else (1, 2, 3)
        return np.where(real, rng.choice(real_values, size=real.shape), 0).astype(dtype)
    if value.dtype == ir.DataType.BOOL:
        return rng.random(shape) < 0.5
    if value.dtype in _INTEGER_TYPES:
        return rng.integers(0, 4, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def _padding_pattern(batch: int, kv: int, rng) -> np.ndarray:
    """bool [batch, kv], True = real: rows cycle through full, right-padded, left-padded and holes."""
    real = np.ones((batch, kv), bool)
    positions = np.arange(kv)
    for row in range(batch):
        length = int(rng.integers(1, kv))
        kind = row % 4
        if kind == 1:
            real[row] = positions < length
        elif kind == 2:
            real[row] = positions >= kv - length
        elif kind == 3:
            real[row] = rng.random(kv) < 0.6
            real[row, rng.integers(0, kv)] = True
    return real


def _term_kind(values: list[np.ndarray]) -> str:
    """"zero", "mask" (0 or a masking fill), "bias" (finite, above any fill) or "mixed", over every probe."""
    if all((v == 0).all() for v in values):
        return "zero"
    if all(((v == 0) | (v <= -MIN_FILL_MAGNITUDE)).all() for v in values):
        return "mask"
    if all((np.isfinite(v) & (v > -MIN_FILL_MAGNITUDE)).all() for v in values):
        return "bias"
    raise _NotReadable


def _matches(
    total: np.ndarray, feeds: dict, candidate: ir.Value | None, marks_real: bool, causal: bool, lengths: tuple
) -> bool:
    """Whether ``total`` masks exactly what the candidate does, on every row that has a visible key, and
    spans the op's (q_len, kv_len) ``lengths`` (or broadcasts along them): a mask whose lengths the probe
    feeds did not set consistently (a cache model's rows cut by the past length) says nothing."""
    if total.ndim > 4 or total.ndim < 2:
        return False
    total = total.reshape((1,) * (4 - total.ndim) + total.shape)
    q_len, kv_len = total.shape[-2], total.shape[-1]
    if q_len not in (1, lengths[0]) or kv_len not in (1, lengths[1]) or total.size == 0:
        return False
    blocked = np.zeros((1, 1, q_len, kv_len), bool)
    if candidate is not None:
        real = feeds[candidate.name] != 0
        if real.shape[1] != kv_len or total.shape[0] not in (1, real.shape[0]):
            return False
        padded = ~real if marks_real else real
        blocked = blocked | padded[:, None, None, :]
    if causal:
        if q_len != kv_len:
            return False
        blocked = blocked | (np.arange(kv_len)[None, :] > np.arange(q_len)[:, None])
    masked = total <= -MIN_FILL_MAGNITUDE
    try:
        masked, blocked = np.broadcast_arrays(masked, blocked)
    except ValueError:
        return False
    visible_rows = ~blocked.all(axis=-1, keepdims=True)
    return bool(((masked == blocked) | ~visible_rows).all())
