"""Minimal hand-built ONNX graphs for the per-rule tests, and the checks they share.

A rule is tested on the smallest graph it must rewrite and on near misses it must
leave alone. ORT runs with its graph optimizations disabled, so that ORT's own
fusions can neither hide a rewrite that went wrong nor one that did not happen.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import helper, numpy_helper
from onnxscript.rewriter import pattern

FILL = -1e9  # the reference's masked_fill value

_ELEM_TYPES = {
    np.dtype(np.float32): onnx.TensorProto.FLOAT,
    np.dtype(np.float64): onnx.TensorProto.DOUBLE,
    np.dtype(np.int32): onnx.TensorProto.INT32,
    np.dtype(np.int64): onnx.TensorProto.INT64,
    np.dtype(bool): onnx.TensorProto.BOOL,
}


class Graph:
    """A graph built op by op: ``g.op("MatMul", a, b)`` adds the node and returns its output's name."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def _name(self, prefix: str) -> str:
        return f"{prefix}_{len(self.nodes) + len(self.initializers)}"

    def input(self, name: str, dtype, shape: list | None) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, _ELEM_TYPES[np.dtype(dtype)], shape))
        return name

    def const(self, value, dtype=np.float32, *, as_node: bool = False) -> str:
        """An initializer, or with ``as_node`` a Constant node (how some exporters write scalars)."""
        tensor = numpy_helper.from_array(np.asarray(value, dtype=dtype), self._name("const"))
        if not as_node:
            self.initializers.append(tensor)
            return tensor.name
        return self.op("Constant", value=tensor)

    def op(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", **attributes) -> str | list[str]:
        names = [self._name(op_type.lower()) + (f"_{i}" if outputs > 1 else "") for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, domain=domain, **attributes))
        return names[0] if outputs == 1 else names

    def output(self, name: str, dtype=np.float32) -> str:
        self.outputs.append(helper.make_tensor_value_info(name, _ELEM_TYPES[np.dtype(dtype)], None))
        return name

    def model(self) -> onnx.ModelProto:
        """Opset 23 (+ com.microsoft), IR 10 as ORT 1.31 wants, with onnx's inferred shapes (rules check them)."""
        graph = helper.make_graph(self.nodes, "rule_test", self.inputs, self.outputs, self.initializers)
        opsets = [helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)]
        model = helper.make_model(graph, opset_imports=opsets)
        model.ir_version = 10
        return onnx.shape_inference.infer_shapes(model)


def rewrite(model: onnx.ModelProto, rules: pattern.RewriteRuleSet) -> tuple[onnx.ModelProto, int]:
    """``model`` after one application of ``rules`` (``model`` itself is left as it was), and the count."""
    ir_model = ir.serde.deserialize_model(model)
    count = rules.apply_to_model(ir_model)
    return ir.serde.serialize_model(ir_model), count


def op_types(model: onnx.ModelProto) -> list[str]:
    """The node types in graph order, ``domain.Op`` outside the default domain; Constants left out."""
    return [f"{n.domain}.{n.op_type}" if n.domain else n.op_type for n in model.graph.node if n.op_type != "Constant"]


def node(model: onnx.ModelProto, op_type: str) -> onnx.NodeProto:
    (found,) = [n for n in model.graph.node if n.op_type == op_type]
    return found


def attributes(node_: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node_.attribute}


def failed_checks(model: onnx.ModelProto, rules: pattern.RewriteRuleSet) -> list[str]:
    """Why ``rules``' checks refused ``model``, from the rewriter's match tracing (which changes nothing)."""
    tracer = pattern.MatchingTracer()
    rules.apply_to_model(ir.serde.deserialize_model(model), tracer=tracer)
    return [
        info.match_result.reason
        for infos in tracer.best_matches_map.values()
        for info in infos
        if info.status == pattern.MatchStatus.CONDITION_FAILED
    ]


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


def executed_nodes(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> set[str]:
    """Names of the nodes ORT ran for ``feeds`` (from its profile): shows which branch of an If was taken."""
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tmp, "profile"))
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        session.run(None, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    suffix = "_kernel_time"
    return {e["name"][: -len(suffix)] for e in events if e.get("cat") == "Node" and e["name"].endswith(suffix)}


def short_sequence_graphs(model: onnx.ModelProto | onnx.GraphProto) -> dict[str, onnx.GraphProto] | None:
    """The branches of short_sequence's If in the graph: "short" (the standard Attention op) and "long";
    None when the graph's If is not one (its then branch runs no standard Attention)."""
    graph = model.graph if isinstance(model, onnx.ModelProto) else model
    (node,) = [n for n in graph.node if n.op_type == "If"]
    graphs = {a.name: a.g for a in node.attribute}
    standard = [n for n in graphs["then_branch"].node if n.op_type == "Attention" and n.domain == ""]
    return {"short": graphs["then_branch"], "long": graphs["else_branch"]} if standard else None


def padding_flash_graphs(model: onnx.ModelProto) -> dict[str, onnx.GraphProto]:
    """The branches padding_flash builds, by role: "flash" (no key padded), "cut" (padded: keys cut to the
    longest row's real ones), and within "cut", "cut_flash" (every row fills the cut) and "cut_masked".
    Under short_sequence's If they are in its long branch, and its "short" branch is returned too."""
    short = short_sequence_graphs(model)
    graph = short["long"] if short else model.graph
    (outer,) = [n for n in graph.node if n.op_type == "If"]
    outer_graphs = {a.name: a.g for a in outer.attribute}
    (inner,) = [n for n in outer_graphs["then_branch"].node if n.op_type == "If"]
    inner_graphs = {a.name: a.g for a in inner.attribute}
    return {
        **({"short": short["short"]} if short else {}),
        "flash": outer_graphs["else_branch"],
        "cut": outer_graphs["then_branch"],
        "cut_flash": inner_graphs["then_branch"],
        "cut_masked": inner_graphs["else_branch"],
    }


def padding_flash_ran(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> set[str]:
    """Which attention ops of padding_flash ("flash", "cut_flash", "cut_masked") and short_sequence ("short")
    ORT ran for ``feeds``: each branch's op is its last node."""
    ran = executed_nodes(model, feeds)
    graphs = padding_flash_graphs(model)
    roles = ("short", "flash", "cut_flash", "cut_masked")
    return {role for role in roles if role in graphs and graphs[role].node[-1].name in ran}


def assert_same_outputs(
    before: onnx.ModelProto,
    after: onnx.ModelProto,
    feeds: dict[str, np.ndarray],
    atol=1e-5,
    rtol=1e-4,
    rows: np.ndarray | None = None,
) -> None:
    """Every output of ``after`` equals ``before``'s; on failure, says which elements differ and by how much.

    ``rows`` (bool [batch, seq]): compare only those rows of each output, and require the others to be
    finite (padded query rows, which the parity contract leaves free).
    """
    expected, actual = run(before, feeds), run(after, feeds)
    assert list(actual) == list(expected)
    for name, want in expected.items():
        got = actual[name]
        assert got.shape == want.shape, f"{name}: shape {got.shape}, expected {want.shape}"
        assert np.isfinite(got).all(), f"{name}: {int((~np.isfinite(got)).sum())} elements are not finite"
        if rows is not None:
            got, want = np.where(rows[..., None], got, 0), np.where(rows[..., None], want, 0)
        bad = ~np.isclose(got, want, atol=atol, rtol=rtol)
        if bad.any():
            where = [tuple(int(i) for i in index) for index in np.argwhere(bad)[:5]]
            detail = ", ".join(f"{i}: {got[i]:.6g} vs {want[i]:.6g}" for i in where)
            raise AssertionError(
                f"{name}: {int(bad.sum())} of {bad.size} elements differ (atol={atol}, rtol={rtol}), "
                f"max |diff| {float(np.abs(got - want).max()):.3g}; first: {detail}"
            )


# --- masks as the export writes them, after masked_fill_bias -------------------------------------


def key_padding_mask(g: Graph, batch: int, kv_len: int, name: str = "key_padding_mask") -> str:
    """bool [batch, kv_len] input, True = real token -> its boolean mask [batch, 1, 1, kv_len]."""
    g.input(name, bool, [batch, kv_len])
    return g.op("Unsqueeze", name, g.const([1, 2], np.int64))


def positions(g: Graph, seq_len: int) -> str:
    """``Range(0, seq_len, 1)``: [seq_len] int64."""
    return g.op("Range", g.const(0, np.int64), g.const(seq_len, np.int64), g.const(1, np.int64))


def causal_mask(g: Graph, seq_len: int, kv_positions: str | None = None) -> str:
    """``kv_pos[None, :] <= q_pos[:, None]`` from one Range, [seq_len, seq_len] (or a second Range for keys)."""
    q_positions = positions(g, seq_len)
    kv = g.op("Unsqueeze", kv_positions or q_positions, g.const([0], np.int64))
    return g.op("LessOrEqual", kv, g.op("Unsqueeze", q_positions, g.const([1], np.int64)))


def mask_bias(g: Graph, mask: str, fill: float = FILL, expand_to: list[int] | None = None) -> str:
    """``Where(Equal(Cast(mask), 0), fill, 0)``: the additive bias masked_fill_bias builds, optionally
    Expanded to [batch, 1, q_len, kv_len] as upstream's MHA fusion does for the contrib ops."""
    masked = g.op("Equal", g.op("Cast", mask, to=onnx.TensorProto.INT64), g.const(0, np.int64))
    bias = g.op("Where", masked, g.const(fill), g.const(0.0))
    return g.op("Expand", bias, g.const(expand_to, np.int64)) if expand_to else bias


def contrib_mha(
    batch: int, q_len: int, kv_len: int, hidden: int, heads: int, *, padding: bool = False, bias: bool = False,
    scale: float | None = None, unidirectional: int = 0, attention_bias: bool = False, mask_index: bool = False,
    mask_shape: tuple[int, ...] | None = None,
) -> onnx.ModelProto:
    """Contrib MHA over query [batch, q_len, hidden] and key/value [batch, kv_len, hidden], as native_mask
    leaves it: ``padding``, an int32 key_padding_mask [batch, kv_len] (or ``mask_shape``) cast from the bool
    input; ``mask_index``, a 1-D [batch] lengths input instead; ``attention_bias``, a float [batch, 1, q, kv]."""
    g = Graph()
    q = g.input("query", np.float32, [batch, q_len, hidden])
    k = g.input("key", np.float32, [batch, kv_len, hidden])
    v = g.input("value", np.float32, [batch, kv_len, hidden])
    inputs = [q, k, v, g.const(normal((3 * hidden,), 5)) if bias else "", "", ""]
    if mask_index:
        inputs[4] = g.input("lengths", np.int32, [batch])
    elif padding:
        g.input("key_padding_mask", bool, list(mask_shape or (batch, kv_len)))
        inputs[4] = g.op("Cast", "key_padding_mask", to=6)  # int32
    if attention_bias:
        inputs[5] = g.input("attention_bias", np.float32, [batch, 1, q_len, kv_len])
    attributes = {"num_heads": heads, "unidirectional": unidirectional, "mask_filter_value": FILL}
    if scale is not None:
        attributes["scale"] = scale
    g.output(g.op("MultiHeadAttention", *inputs, domain="com.microsoft", **attributes))
    return g.model()


def padding_sides(batch: int, seq: int, side: str, seed: int = 0) -> np.ndarray:
    """bool [batch, seq], True = real: random lengths >= 1 with padding on the ``side`` ("right", "left",
    "mixed": alternating), row 0 full length; "empty-row": the last row is all padding."""
    lengths = np.random.default_rng(seed).integers(1, seq + 1, size=batch)
    lengths[0] = seq
    positions = np.arange(seq)[None, :]
    right, left = positions < lengths[:, None], positions >= (seq - lengths)[:, None]
    if side == "right":
        return right
    if side == "left":
        return left
    if side == "mixed":
        return np.where((np.arange(batch) % 2 == 0)[:, None], left, right)
    mask = right.copy()
    mask[-1] = False
    return mask


def padding_feeds(batch: int, kv_len: int, seed: int = 0) -> np.ndarray:
    """Right padding, every sequence keeps at least its first token (rows with no visible key are padding)."""
    lengths = np.random.default_rng(seed).integers(1, kv_len + 1, size=batch)
    lengths[0] = kv_len
    return np.arange(kv_len)[None, :] < lengths[:, None]


def normal(shape, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
