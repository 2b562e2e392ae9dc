"""`mha-deploy optimize`: users' models (tests/user_models) exported by plain torch.onnx.export, as their authors
would, then fused, checked against that graph in ORT, and run by MHASession; bad declarations as one-line
errors that name the input and leave nothing behind."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from click.testing import CliRunner  # noqa: E402

from mha_deploy.cli import main  # noqa: E402
from mha_deploy.compare import compare_outputs  # noqa: E402
from mha_deploy.errors import ExportError, MHADeployError, ParityError  # noqa: E402
from mha_deploy.exporters import optimize_model, token_packing  # noqa: E402
from mha_deploy.inputs import InputCase, make_inputs, real_query_rows  # noqa: E402
from mha_deploy.model_report import all_nodes  # noqa: E402
from mha_deploy.runtime import MHASession  # noqa: E402
from tests.conftest import user_module  # noqa: E402
from tests.exporters.test_own_model import _attention_sites  # noqa: E402

# (user model, opset): one graph per opset the exporter writes at both ends of the range.
EXPORTED = [("classifier", 18), ("causal_lm", 23)]
# What each model returns: a row per item (the classifier's 3 classes) or per token (the LM's 50 logits).
OUTPUT_AXES = {"classifier": ("batch", 3), "causal_lm": ("batch", "seq", 50)}
ATOL, RTOL = 2e-5, 1e-4
_TRACE_BATCH, _TRACE_SEQ = 2, 7


def _export_elsewhere(name: str, path, opset: int, mask_dtype=torch.bool, dynamo: bool = True,
                      ids_dtype=torch.int64) -> None:
    """torch.onnx.export of tests/user_models/<name>.py (token ids and a padding mask) as its author would run it:
    dynamic batch and length, no mha-deploy involved."""
    module = user_module(name)
    model = module.build().eval()
    names = [spec.split(":")[0] for spec in module.INPUTS]
    args = (torch.randint(0, 50, (_TRACE_BATCH, _TRACE_SEQ), dtype=ids_dtype),
            torch.ones(_TRACE_BATCH, _TRACE_SEQ, dtype=mask_dtype))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if dynamo:
            batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
            torch.onnx.export(model, args, str(path), dynamo=True, opset_version=opset, input_names=names,
                              dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}), verbose=False)
        else:
            torch.onnx.export(model, args, str(path), dynamo=False, opset_version=opset, input_names=names,
                              dynamic_axes={n: {0: "batch_size", 1: "sequence"} for n in names})


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory):
    """``elsewhere(name, opset, mask_dtype="bool", dynamo=True, ids_dtype="int64") -> path``, exported once per
    arguments."""
    cache = {}

    def export(name: str, opset: int, mask_dtype: str = "bool", dynamo: bool = True, ids_dtype: str = "int64"):
        key = name, opset, mask_dtype, dynamo, ids_dtype
        if key not in cache:
            path = tmp_path_factory.mktemp("elsewhere") / f"{name}-{opset}-{mask_dtype}-{dynamo}-{ids_dtype}.onnx"
            _export_elsewhere(name, path, opset, getattr(torch, mask_dtype), dynamo, getattr(torch, ids_dtype))
            cache[key] = path
        return cache[key]

    return export


@pytest.fixture(scope="module")
def optimized(elsewhere, tmp_path_factory):
    """``optimized(name, opset) -> (source, written path, ExportResult)`` with the model's own declarations."""
    cache = {}

    def optimize(name: str, opset: int):
        if (name, opset) not in cache:
            source = elsewhere(name, opset)
            path = tmp_path_factory.mktemp("optimized") / f"{name}-{opset}.onnx"
            cache[name, opset] = source, path, optimize_model(source, path, user_module(name).INPUTS)
        return cache[name, opset]

    return optimize


def _input_graph(source, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The graph as exported, in a plain ORT session, fed in its own input types."""
    session = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    types = {i.name: i.type for i in session.get_inputs()}
    own = {"tensor(bool)": bool, "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32}
    outputs = session.run(None, {name: feeds[name].astype(own[types[name]]) for name in types})
    return dict(zip([o.name for o in session.get_outputs()], outputs, strict=True))


def _assert_equal_on_real_rows(session: MHASession, got: dict, expected: dict, feeds: dict) -> None:
    signature = session.signature
    for comparison in compare_outputs(signature, got, expected, real_query_rows(signature, feeds), ATOL, RTOL):
        assert comparison.passed, comparison.summary()


@pytest.mark.parametrize(("name", "opset"), EXPORTED)
def test_every_attention_is_fused_and_checked(optimized, name, opset):
    _, path, result = optimized(name, opset)
    model = onnx.load(str(path))
    assert result.fusion.target == "mha" and result.fusion.fused == 2 and result.fusion.complete
    assert _attention_sites(model.graph) == 2
    assert not [node.name for node in all_nodes(model.graph) if node.op_type == "Softmax"]
    assert result.parity.passed
    assert {shape.split("/")[-1] for shape in result.parity.shapes} >= {"right", "left", "mixed"}
    assert result.warnings == []


@pytest.mark.parametrize(("name", "opset"), EXPORTED)
def test_session_matches_the_input_graph(optimized, name, opset):
    source, path, _ = optimized(name, opset)
    session = MHASession(path, provider="cpu")
    signature = session.signature
    assert [spec.dtype for spec in signature.inputs] == ["int64", "bool"]
    [output] = signature.outputs
    assert output.axes == OUTPUT_AXES[name]
    assert signature.paddable_axes == {"seq"}
    assert session.metadata.num_heads == 4 and session.metadata.d_model == 32 and session.metadata.opset == opset
    for index, (batch, length, side) in enumerate([(3, 23, "left"), (2, 37, "right"), (4, 9, "mixed")]):
        feeds = make_inputs(signature, session.metadata.d_model, InputCase(batch, length, length, side), seed=index)
        _assert_equal_on_real_rows(session, session.run(feeds), {output.name: _input_graph(source, feeds)[output.name]},
                                   feeds)


def test_onnx_target_on_an_opset_23_graph(elsewhere, tmp_path):
    result = optimize_model(elsewhere("causal_lm", 23), tmp_path / "m.onnx", user_module("causal_lm").INPUTS,
                            fuse="onnx")
    assert result.fusion.fused == 2 and {op.op_type for op in result.fusion.ops} == {"Attention"}
    assert result.parity.passed


def test_an_integer_mask_and_int32_ids_are_cast_so_the_model_takes_bool_and_int64(elsewhere, tmp_path):
    # A tokenizer's attention_mask is int64; some exports take int32 ids.
    source = elsewhere("classifier", 18, mask_dtype="int64", ids_dtype="int32")
    graph_types = {i.name: i.type.tensor_type.elem_type for i in onnx.load(str(source)).graph.input}
    assert graph_types == {"input_ids": onnx.TensorProto.INT32, "attention_mask": onnx.TensorProto.INT64}
    path = tmp_path / "m.onnx"
    result = optimize_model(source, path, user_module("classifier").INPUTS)
    assert result.fusion.fused == 2 and result.parity.passed
    written = {i.name: i.type.tensor_type.elem_type for i in onnx.load(str(path)).graph.input}
    assert written == {"input_ids": onnx.TensorProto.INT64, "attention_mask": onnx.TensorProto.BOOL}
    session = MHASession(path, provider="cpu")
    feeds = make_inputs(session.signature, 32, InputCase(3, 19, 19, "left"), seed=5)
    _assert_equal_on_real_rows(session, session.run(feeds), {"linear_12": _input_graph(source, feeds)["linear_12"]},
                               feeds)


def test_legacy_exporter_graph_with_its_own_names(elsewhere, tmp_path):
    # The TorchScript exporter names values by number ("onnx::MatMul_240", outputs too) and dims as it was told.
    source = elsewhere("causal_lm", 18, dynamo=False)
    [graph_output] = [o.name for o in onnx.load(str(source)).graph.output]
    path = tmp_path / "m.onnx"
    result = optimize_model(source, path, user_module("causal_lm").INPUTS, output_names=["logits"])
    assert result.parity.passed
    # Whatever the fusion chain makes of this graph, auto never writes it unchecked: fused, or the plain graph
    # with a warning that says why.
    assert result.fusion.fused == 2 or any("--fuse auto: mha fusion not used" in w for w in result.warnings)
    session = MHASession(path, provider="cpu")
    assert session.output_names == ("logits",) and session.signature.outputs[0].axes == ("batch", "seq", 50)
    feeds = make_inputs(session.signature, 32, InputCase(2, 29, 29, "left"), seed=2)
    _assert_equal_on_real_rows(session, session.run(feeds), {"logits": _input_graph(source, feeds)[graph_output]},
                               feeds)


def test_output_shapes_missing_from_the_graph_are_measured(elsewhere, optimized, tmp_path):
    source = tmp_path / "no-shapes.onnx"
    model = onnx.load(str(elsewhere("causal_lm", 23)))
    model.graph.output[0].type.tensor_type.ClearField("shape")
    onnx.save(model, str(source))
    result = optimize_model(source, tmp_path / "m.onnx", user_module("causal_lm").INPUTS)
    assert result.metadata.signature == optimized("causal_lm", 23)[2].metadata.signature


def _with_fill(source, fill: float, target):
    """The graph with its masked_fill value replaced: -1.0 is a soft penalty, which no fusion rule may take
    for a mask."""
    model = onnx.load(str(source))
    for node in model.graph.node:
        if node.op_type == "Constant":
            value = onnx.numpy_helper.to_array(node.attribute[0].t)
            if value.size == 1 and value.dtype == np.float32 and float(value) == -1e9:
                node.attribute[0].t.CopyFrom(onnx.numpy_helper.from_array(np.array(fill, value.dtype).reshape(
                    value.shape)))
    for tensor in model.graph.initializer:
        value = onnx.numpy_helper.to_array(tensor)
        if value.size == 1 and value.dtype == np.float32 and float(value) == -1e9:
            tensor.CopyFrom(onnx.numpy_helper.from_array(np.array(fill, value.dtype).reshape(value.shape), tensor.name))
    onnx.save(model, str(target))
    return target


@pytest.mark.parametrize("fuse", ["mha", "onnx"])
def test_explicit_fusion_names_the_attention_it_cannot_fuse_and_writes_nothing(elsewhere, tmp_path, fuse):
    source = _with_fill(elsewhere("causal_lm", 23), -1.0, tmp_path / "soft.onnx")
    target = tmp_path / "out" / "m.onnx"
    target.parent.mkdir()
    with pytest.raises(ExportError) as raised:
        optimize_model(source, target, user_module("causal_lm").INPUTS, fuse=fuse)
    message = str(raised.value)
    assert "2 left unfused" in message and "fill -1.0 is not a masking value" in message
    softmaxes = [n.name for n in onnx.load(str(source)).graph.node if n.op_type == "Softmax"]
    assert all(name in message for name in softmaxes) and "\n" not in message
    assert list(target.parent.iterdir()) == []


def test_auto_falls_back_to_the_checked_plain_graph(elsewhere, tmp_path):
    source = _with_fill(elsewhere("causal_lm", 23), -1.0, tmp_path / "soft.onnx")
    result = optimize_model(source, tmp_path / "m.onnx", user_module("causal_lm").INPUTS)
    assert result.fusion.target == "none" and result.parity.passed
    assert any("--fuse auto: mha fusion not used" in w and "not a masking value" in w for w in result.warnings)
    assert MHASession(tmp_path / "m.onnx", provider="cpu").metadata.fusion == "none"


def _off_by(amount: float):
    """fuse_attention, then every float bias of the fused graph moved by ``amount``: a fusion parity must refuse."""
    from mha_deploy.exporters.fusion import fuse_attention

    def fuse(model, target, **options):
        fused, report = fuse_attention(model, target, **options)
        if target != "none":
            for tensor in fused.graph.initializer:
                if tensor.name.endswith("bias") and tensor.data_type == onnx.TensorProto.FLOAT:
                    array = onnx.numpy_helper.to_array(tensor) + amount
                    tensor.CopyFrom(onnx.numpy_helper.from_array(array.astype(np.float32), tensor.name))
        return fused, report

    return fuse


def test_parity_failure_writes_nothing_and_auto_falls_back(elsewhere, tmp_path, monkeypatch):
    monkeypatch.setattr("mha_deploy.exporters.export.fuse_attention", _off_by(1e-3))
    source, inputs = elsewhere("classifier", 18), user_module("classifier").INPUTS
    with pytest.raises(ParityError, match=r"parity FAILED.*nothing written"):
        optimize_model(source, tmp_path / "m.onnx", inputs, fuse="mha")
    assert not (tmp_path / "m.onnx").exists()
    result = optimize_model(source, tmp_path / "m.onnx", inputs)
    assert result.fusion.target == "none" and any("parity FAILED" in w for w in result.warnings)


def test_a_file_a_load_would_refuse_is_refused_in_the_same_words_and_not_written(elsewhere, tmp_path, monkeypatch):
    """optimize runs the load check on the file it is about to write, as export does: metadata the graph
    contradicts (heads recorded as 7 over 4-head attentions) is refused with the load's words, nothing written."""
    from mha_deploy.errors import ModelFileError

    monkeypatch.setattr("mha_deploy.exporters.export.graph_heads", lambda model, d_model: {7})
    with pytest.raises(ModelFileError, match=r"m.onnx: the graph's attentions split up to 4 heads, its metadata says "
                                             r"7; the load check every session runs would refuse the file") as info:
        optimize_model(elsewhere("classifier", 18), tmp_path / "m.onnx", user_module("classifier").INPUTS)
    assert isinstance(info.value, ExportError)
    assert list(tmp_path.iterdir()) == []


def _static_batch(source, target):
    model = onnx.load(str(source))
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2
    onnx.save(model, str(target))
    return target


@pytest.mark.parametrize(
    ("inputs", "fragment"),
    [
        (["ids:tokens", "attention_mask:padding-mask"], "input ids: "),
        (["input_ids:tokens"], "also takes attention_mask: declare every input"),
        (["input_ids:sequence", "attention_mask:padding-mask"], "input input_ids: declared a sequence"),
        (["input_ids:tokens", "attention_mask:tokens"], "input attention_mask: declared token ids"),
        (["input_ids:padding-mask", "attention_mask:padding-mask"], "input input_ids: a padding mask marks"),
        (["input_ids:tokens", "attention_mask:padding-mask:other"], "input attention_mask: a padding mask marks"),
        (["input_ids:tokens", "attention_mask:padding-mask", "extra:tokens"], "input extra: "),
        (["input_ids:talk"], "role must be one of"),
    ],
)
def test_bad_declarations_are_one_line_errors_naming_the_input(elsewhere, tmp_path, inputs, fragment):
    target = tmp_path / "m.onnx"
    with pytest.raises(MHADeployError) as raised:
        optimize_model(elsewhere("classifier", 18), target, inputs)
    assert fragment in str(raised.value) and "\n" not in str(raised.value)
    assert not target.exists()


@pytest.mark.parametrize(
    ("change", "kwargs", "fragment"),
    [
        (_static_batch, {}, "input input_ids: the graph fixes its batch axis (axis 0) at 2"),
        (None, {"output_names": ["a", "b"]}, "2 output names given, the graph has 1 outputs"),
        (None, {"fuse": "onnx"}, "--fuse onnx needs opset >= 23"),
        (None, {"fuse": "flash"}, "fuse must be one of auto, mha, onnx, none"),
    ],
)
def test_graphs_and_options_that_cannot_be_optimized(elsewhere, tmp_path, change, kwargs, fragment):
    source = elsewhere("classifier", 18)
    if change is not None:
        source = change(source, tmp_path / "changed.onnx")
    target = tmp_path / "out" / "m.onnx"
    target.parent.mkdir()
    with pytest.raises(ExportError) as raised:
        optimize_model(source, target, user_module("classifier").INPUTS, **kwargs)
    assert fragment in str(raised.value)
    assert list(target.parent.iterdir()) == []


def test_cli_optimize(elsewhere, tmp_path):
    target = tmp_path / "m.onnx"
    inputs = [arg for spec in user_module("classifier").INPUTS for arg in ("--input", spec)]
    result = CliRunner().invoke(main, ["optimize", str(elsewhere("classifier", 18)), *inputs, "--output-name",
                                       "logits", "-o", str(target)])
    assert result.exit_code == 0, result.output
    assert "2 attention subgraph(s) found, 2 fused" in result.stdout and "parity PASSED" in result.stdout
    assert f"wrote {target}" in result.stdout
    assert MHASession(target, provider="cpu").output_names == ("logits",)


def test_cli_optimize_help_shows_an_example():
    result = CliRunner().invoke(main, ["optimize", "--help"])
    assert result.exit_code == 0 and "mha-deploy optimize model.onnx --input" in result.output


def test_cli_optimize_bad_declaration_exits_1_with_one_line(elsewhere, tmp_path):
    target = tmp_path / "m.onnx"
    result = CliRunner().invoke(main, ["optimize", str(elsewhere("classifier", 18)), "--input", "input_ids:sequence",
                                       "--input", "attention_mask:padding-mask", "-o", str(target)])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1].startswith("error: input input_ids: declared a sequence")
    assert "Traceback" not in result.output and not target.exists()


class _SdpaNoMask(torch.nn.Module):
    """F.scaled_dot_product_attention without a mask: torch exports it as the standard Attention op (opset 23)."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, 2, 8).transpose(1, 2) for proj in self.qkv)
        return self.out(torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, 16))


def test_a_graph_holding_torchs_attention_op_is_counted_and_fused(tmp_path):
    source = tmp_path / "sdpa.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        axes = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")}
        torch.onnx.export(_SdpaNoMask().eval(), (torch.randn(2, 5, 16),), source, dynamo=True, opset_version=23,
                          input_names=["x"], dynamic_shapes=(axes,))
    assert [n.op_type for n in onnx.load(str(source)).graph.node].count("Attention") == 1
    result = optimize_model(source, tmp_path / "fused.onnx", ["x:sequence"], fuse="mha")
    assert result.fusion.found == 1 and result.fusion.fused == 1 and result.parity.passed


@pytest.mark.parametrize(("name", "mask_dtype"), [("classifier", "bool"), ("causal_lm", "int64")])
def test_a_graph_from_elsewhere_is_packed_and_matches_the_input_graph(elsewhere, tmp_path, monkeypatch, name,
                                                                      mask_dtype):
    # The test models are too narrow for packing to pay (token_packing.MIN_WORK_PER_COPIED_ELEMENT): pack anyway.
    monkeypatch.setattr(token_packing, "MIN_WORK_PER_COPIED_ELEMENT", 0)
    source = elsewhere(name, 18, mask_dtype)
    result = optimize_model(source, tmp_path / "m.onnx", user_module(name).INPUTS)
    assert result.packing is not None and result.packing.runs >= 1 and result.packing.matmuls >= 8, result.packing
    assert result.parity.passed and not [w for w in result.warnings if "token packing" in w]
    session = MHASession(result.path, provider="cpu")
    signature = session.signature
    for index, (batch, length, side) in enumerate([(3, 23, "left"), (2, 37, "right"), (4, 9, "mixed")]):
        feeds = make_inputs(signature, session.metadata.d_model, InputCase(batch, length, length, side), seed=index)
        name_ = signature.outputs[0].name
        _assert_equal_on_real_rows(session, session.run(feeds), {name_: _input_graph(source, feeds)[name_]}, feeds)


def test_a_graph_from_elsewhere_is_quantized_and_judged_against_itself(elsewhere, tmp_path):
    """optimize --quantize int8: every MatMul with a constant weight as MatMulNBits, the attentions fused, the
    error against the input graph (fp32, in ORT) within int8's budget and recorded with the logits' top-1."""
    source = elsewhere("causal_lm", 18)
    path = tmp_path / "m.onnx"
    result = optimize_model(source, path, user_module("causal_lm").INPUTS, output_names=["logits"], quantize="int8")
    assert result.fusion.fused == 2 and result.parity.passed and result.parity.rel_budget == 0.05
    assert 0 < result.parity.rel_err < 0.05 and result.parity.top1_agreement > 0.9
    metadata = MHASession(path, provider="cpu").metadata
    assert metadata.quantization == "int8" and metadata.weight_only.bits == 8 and metadata.weight_only.matmuls > 0
