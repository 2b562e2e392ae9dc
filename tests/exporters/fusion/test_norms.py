"""fusion.norms: RMSNorm as written out by torch -> SimplifiedLayerNormalization, with its residual Add ->
com.microsoft.SkipSimplifiedLayerNormalization, equal to the unfused graph (ORT's own fusions off); the near misses
left alone; the tiny Hugging Face Llama's export holding 2 per layer and the final one, its parity passed."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper

from mha_deploy.exporters.fusion.norms import fuse_norms, rms_norm_rules, skip_rms_norm_rules
from tests.exporters.fusion import hand_graphs as hg

BATCH, SEQ, D = 2, 5, 16
EPS = 1e-6  # not the ops' default 1e-5: the fused op must carry the graph's
SIMPLIFIED, SKIP = "SimplifiedLayerNormalization", "com.microsoft.SkipSimplifiedLayerNormalization"
_TYPES = {np.float32: onnx.TensorProto.FLOAT, np.float16: onnx.TensorProto.FLOAT16}


def _input(g: hg.Graph, name: str, dtype=np.float32, shape=("batch", "seq", D)) -> str:
    g.inputs.append(helper.make_tensor_value_info(name, _TYPES[dtype], list(shape)))
    return name


def _output(g: hg.Graph, name: str, dtype=np.float32) -> None:
    g.outputs.append(helper.make_tensor_value_info(name, _TYPES[dtype], None))


def _rms(g: hg.Graph, x: str, scale: str | None, *, scale_first=True, eps: str | None = None, cast_to=None,
         rsqrt_of=None, defaults_written=True) -> str:
    """Torch's export of ``x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)`` times ``scale``; ``cast_to``: Llama's
    ``x.to(float32)`` ... ``.to(input_dtype)`` around it, back to that type; ``defaults_written``: ReduceMean's
    keepdims and noop_with_empty_axes written out as torch writes them (other exporters leave them out)."""
    if cast_to is not None:
        x = g.op("Cast", x, to=onnx.TensorProto.FLOAT)
    defaults = {"keepdims": 1, "noop_with_empty_axes": 0} if defaults_written else {}
    mean = g.op("ReduceMean", g.op("Pow", x, g.const(2.0)), g.const([-1], np.int64), **defaults)
    root = g.op("Sqrt", g.op("Add", mean, eps or g.const(EPS))) if rsqrt_of is None else rsqrt_of(mean)
    normed = g.op("Mul", x, g.op("Reciprocal", root))
    if cast_to is not None:
        normed = g.op("Cast", normed, to=_TYPES[cast_to])
    if scale is None:
        return normed
    return g.op("Mul", scale, normed) if scale_first else g.op("Mul", normed, scale)


def _weight(seed=1, dtype=np.float32):
    return 1 + 0.5 * hg.normal((D,), seed).astype(dtype)


def _feeds(model: onnx.ModelProto, seed=0) -> dict[str, np.ndarray]:
    feeds = {}
    for i, value in enumerate(model.graph.input):
        dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        dims = [d.dim_value or {"batch": BATCH, "seq": SEQ}[d.dim_param] for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = (3 * hg.normal(dims, seed + i)).astype(dtype)
    return feeds


def _fused(model: onnx.ModelProto, target="mha") -> tuple[onnx.ModelProto, dict[str, int]]:
    ir_model = ir.serde.deserialize_model(model)
    counts = fuse_norms(ir_model, target)
    return ir.serde.serialize_model(ir_model), counts


def _epsilons(model: onnx.ModelProto) -> list[float]:
    return [hg.attributes(n)["epsilon"] for n in model.graph.node if "Normalization" in n.op_type]


# --- one norm: must be rewritten ---------------------------------------------------------------------------------


def _plain(form: str) -> tuple[onnx.ModelProto, float]:
    """The norm of one graph input as a model's forms write it, and the tolerance against the unfused graph."""
    g = hg.Graph()
    if form == "llama-fp16":  # x.to(float32) ... weight * x.to(float16): the weight multiplies in fp16
        x = _input(g, "x", np.float16)
        _output(g, _rms(g, x, g.const(_weight(), np.float16), cast_to=np.float16), np.float16)
        return g.model(), 2e-3
    x = _input(g, "x")
    if form == "defaults-omitted":
        _output(g, _rms(g, x, g.const(_weight()), defaults_written=False))
    elif form == "gemma-unfolded":  # x_normed * (1 + weight), the Add left by the export's optimizer
        scale = g.op("Add", g.const(1.0), g.const(_weight() - 1))
        _output(g, _rms(g, x, scale, scale_first=False))
    else:
        _output(g, _rms(g, x, g.const(_weight()), scale_first=form == "scale-first"))
    return g.model(), 1e-5


@pytest.mark.parametrize("form", ["scale-first", "scale-last", "defaults-omitted", "gemma-unfolded", "llama-fp16"])
def test_an_rms_norm_becomes_one_op_with_the_graphs_epsilon(form):
    model, tol = _plain(form)
    fused, counts = _fused(model)
    assert counts == {"rms_norm": 1, "rms_normalization": 0, "skip_rms_norm": 0}
    assert hg.op_types(fused) == [SIMPLIFIED] and _epsilons(fused) == [pytest.approx(EPS)]
    hg.assert_same_outputs(model, fused, _feeds(model), atol=tol, rtol=tol)


def test_a_norm_fed_by_a_residual_add_takes_it_and_returns_the_sum():
    """h = x + attn; y = norm(h); h is read again by the next residual: both outputs come from the one op."""
    g = hg.Graph()
    x, attn = _input(g, "x"), _input(g, "attn")
    h = g.op("Add", x, attn)
    _output(g, _rms(g, h, g.const(_weight())))
    _output(g, g.op("Add", h, g.op("Relu", h)))  # the next residual reads the sum
    model = g.model()
    fused, counts = _fused(model)
    assert counts == {"rms_norm": 1, "rms_normalization": 0, "skip_rms_norm": 1}
    assert hg.op_types(fused) == [SKIP, "Relu", "Add"]
    assert _epsilons(fused) == [pytest.approx(EPS)]
    hg.assert_same_outputs(model, fused, _feeds(model), atol=1e-5, rtol=1e-5)


def test_a_bias_added_before_the_residual_goes_into_the_skip_op():
    g = hg.Graph()
    x, projected = _input(g, "x"), _input(g, "projected")
    _output(g, _rms(g, g.op("Add", g.op("Add", projected, g.const(hg.normal((D,), 3))), x), g.const(_weight())))
    model = g.model()
    fused, counts = _fused(model)
    assert counts["skip_rms_norm"] == 1 and hg.op_types(fused) == [SKIP]
    assert len(hg.node(fused, "SkipSimplifiedLayerNormalization").input) == 4  # input, skip, gamma, bias
    hg.assert_same_outputs(model, fused, _feeds(model), atol=1e-5, rtol=1e-5)


def test_the_onnx_target_writes_onnx_rms_normalization_and_no_contrib_op():
    g = hg.Graph()
    x, attn = _input(g, "x"), _input(g, "attn")
    _output(g, _rms(g, g.op("Add", x, attn), g.const(_weight())))
    model = g.model()
    fused, counts = _fused(model, "onnx")
    assert counts == {"rms_norm": 1, "rms_normalization": 1}
    assert hg.op_types(fused) == ["Add", "RMSNormalization"] and _epsilons(fused) == [pytest.approx(EPS)]
    hg.assert_same_outputs(model, fused, _feeds(model), atol=1e-5, rtol=1e-5)


def test_onnx_rms_normalization_as_torch_writes_it_at_opset_23_takes_its_residual_add_too():
    """torch's exporter (onnxscript's optimizer) writes RMSNormalization itself at opset 23; the mha target turns it
    into ORT's kernel op, which the residual Add then joins."""
    g = hg.Graph()
    x, attn = _input(g, "x"), _input(g, "attn")
    _output(g, g.op("RMSNormalization", g.op("Add", x, attn), g.const(_weight()), axis=-1, epsilon=EPS))
    model = g.model()
    fused, counts = _fused(model)
    assert counts == {"rms_norm": 0, "rms_normalization": 1, "skip_rms_norm": 1}
    assert hg.op_types(fused) == [SKIP] and _epsilons(fused) == [pytest.approx(EPS)]
    hg.assert_same_outputs(model, fused, _feeds(model), atol=1e-5, rtol=1e-5)


def test_the_onnx_target_leaves_a_norm_whose_scale_has_another_type():
    """Gemma in fp16: the norm in fp32 times an fp32 scale, then cast back. No standard op takes that on ORT 1.31
    (its RMSNormalization function wants one type), and the onnx target writes no contrib op."""
    g = hg.Graph()
    normed = _rms(g, _input(g, "x", np.float16), None, cast_to=np.float32)
    _output(g, g.op("Cast", g.op("Mul", normed, g.const(_weight())), to=onnx.TensorProto.FLOAT16), np.float16)
    model = g.model()
    left, counts = _fused(model, "onnx")
    assert counts == {"rms_norm": 0, "rms_normalization": 0} and hg.op_types(left) == hg.op_types(model)
    fused, counts = _fused(model)  # the contrib op mixes them
    assert counts["rms_norm"] == 1 and hg.op_types(fused) == [SIMPLIFIED, "Cast"]
    hg.assert_same_outputs(model, fused, _feeds(model), atol=2e-3, rtol=2e-3)


# --- near misses: must be left alone -----------------------------------------------------------------------------


def _weight_input(g):
    """The scale a graph input: a modulation computed at run time, not one weight per feature."""
    return _rms(g, _input(g, "x"), _input(g, "w", shape=(D,)))


def _per_feature_epsilon(g):
    """mean(x^2) + a [d] vector: a [batch, seq, d] denominator, not a norm's scalar epsilon."""
    return _rms(g, _input(g, "x"), g.const(_weight()), eps=g.const(np.full(D, EPS, np.float32)))


def _epsilon_outside_the_root(g):
    """1 / (sqrt(mean(x^2)) + eps): another function of x than the op's 1 / sqrt(mean(x^2) + eps)."""
    return _rms(g, _input(g, "x"), g.const(_weight()), rsqrt_of=lambda mean: g.op("Add", g.op("Sqrt", mean),
                                                                                    g.const(EPS)))


def _layer_norm_written_out(g):
    """LayerNorm by hand: the mean subtracted, divided by the root, a bias added (no reciprocal)."""
    x = _input(g, "x")
    centred = g.op("Sub", x, g.op("ReduceMean", x, g.const([-1], np.int64), keepdims=1))
    var = g.op("ReduceMean", g.op("Pow", centred, g.const(2.0)), g.const([-1], np.int64), keepdims=1)
    normed = g.op("Div", centred, g.op("Sqrt", g.op("Add", var, g.const(EPS))))
    return g.op("Add", g.op("Mul", normed, g.const(_weight())), g.const(hg.normal((D,), 4)))


def _over_the_sequence(g):
    """The mean over axis 1 (the positions), not the features."""
    x = _input(g, "x")
    mean = g.op("ReduceMean", g.op("Pow", x, g.const(2.0)), g.const([1], np.int64), keepdims=1)
    return g.op("Mul", g.const(_weight()), g.op("Mul", x, g.op("Reciprocal", g.op("Sqrt", g.op("Add", mean,
                                                                                               g.const(EPS))))))


def _scale_of_another_width(g):
    """A [1] scale broadcast over the features: not the op's [d] scale."""
    return _rms(g, _input(g, "x"), g.const([2.0]))


@pytest.mark.parametrize("build", [_weight_input, _per_feature_epsilon, _epsilon_outside_the_root,
                                   _layer_norm_written_out, _over_the_sequence, _scale_of_another_width],
                         ids=lambda build: build.__name__.strip("_"))
def test_left_alone(build):
    g = hg.Graph()
    _output(g, build(g))
    model = g.model()
    fused, counts = _fused(model)
    assert counts == {"rms_norm": 0, "rms_normalization": 0, "skip_rms_norm": 0}
    assert hg.op_types(fused) == hg.op_types(model)


def test_why_a_non_constant_scale_is_refused_is_reported():
    g = hg.Graph()
    _output(g, _weight_input(g))
    assert any("scale is not a constant" in why for why in hg.failed_checks(g.model(), rms_norm_rules))


def test_a_layer_norm_with_rsqrt_is_fused_as_the_rms_norm_of_its_centred_values():
    """x - mean(x) is what the norm's Pow reads: the mean subtraction stays in front of the op, exactly."""
    g = hg.Graph()
    x = _input(g, "x")
    centred = g.op("Sub", x, g.op("ReduceMean", x, g.const([-1], np.int64), keepdims=1))
    _output(g, _rms(g, centred, g.const(_weight())))
    model = g.model()
    fused, _ = _fused(model)
    assert hg.op_types(fused) == ["ReduceMean", "Sub", SIMPLIFIED]
    hg.assert_same_outputs(model, fused, _feeds(model), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["broadcast-skip", "mixed-types"])
def test_a_residual_the_skip_op_cannot_take_leaves_the_add(case):
    """A [1, seq, d] addend (a position table) is not a [batch, seq, d] skip; an fp16 sum normed with an fp32
    weight is not the one type the skip op takes. The norm alone is still fused."""
    g = hg.Graph()
    if case == "broadcast-skip":
        x, table = _input(g, "x"), _input(g, "table", shape=(1, "seq", D))
        _output(g, _rms(g, g.op("Add", x, table), g.const(_weight())))
        tol = 1e-5
    else:
        x, attn = _input(g, "x", np.float16), _input(g, "attn", np.float16)
        normed = _rms(g, g.op("Add", x, attn), None, cast_to=np.float32)  # Cast to fp32 and back to fp32
        _output(g, g.op("Mul", normed, g.const(_weight())))
        tol = 2e-3
    model = g.model()
    fused, counts = _fused(model)
    assert counts == {"rms_norm": 1, "rms_normalization": 0, "skip_rms_norm": 0}
    assert "Add" in hg.op_types(fused) and SIMPLIFIED in hg.op_types(fused)
    if case == "mixed-types":
        assert any("different types" in why for why in hg.failed_checks(fused, skip_rms_norm_rules))
    hg.assert_same_outputs(model, fused, _feeds(model), atol=tol, rtol=tol)


# --- the tiny Hugging Face Llama (tests/user_models/hf_llama.py), as `export --kv-cache` writes it -----------------


def _all_nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(attribute.g)


def test_the_tiny_llama_holds_two_fused_norms_per_layer_and_the_final_one(lm_cache):
    pytest.importorskip("transformers")
    from mha_deploy.runtime import MHASession
    from tests.conftest import user_module

    layers = user_module("hf_llama").LAYERS
    path, output = lm_cache("hf_llama")
    ops = [f"{n.domain}.{n.op_type}" if n.domain else n.op_type for n in _all_nodes(onnx.load(str(path)).graph)]
    # each layer's two norms read a residual sum; the first layer's input norm reads the embedding alone, and the
    # final norm reads the last layer's sum
    assert ops.count(SKIP) == 2 * layers and ops.count(SIMPLIFIED) == 1, output
    assert "Pow" not in ops and "Reciprocal" not in ops
    assert f"RMSNorm fused into 1 {SIMPLIFIED}, {2 * layers} {SKIP}" in output
    assert MHASession(path, provider="cpu").metadata.parity.passed
