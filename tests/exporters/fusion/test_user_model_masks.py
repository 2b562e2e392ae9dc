"""torch's own layers and Hugging Face models (tests/user_models), their masks built as the libraries build
them: every attention fused on every execution path, no Softmax left, each padding and causal mask on the
kernel the reference form gets (none materialised: T5's position bias is reported as a bias), and the fused
graph equal to the module on real rows on both padding sides.

Fusion is checked on the plain graph ``export --module`` traces (declare_model + export_onnx, the trace the
other files' exports of each model share), so that it is tested apart from what the rest of the export does;
one model goes through the CLI and ``inspect``.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import onnxruntime as ort  # noqa: E402

from mha_deploy.exporters.fusion import fuse_attention  # noqa: E402
from mha_deploy.exporters.own_model import declare_model, position_tables  # noqa: E402
from mha_deploy.exporters.reference_form import reference_attention, without_fast_path  # noqa: E402
from mha_deploy.exporters.torch_export import DEFAULT_OPSET  # noqa: E402
from mha_deploy.inputs import padding_mask  # noqa: E402
from mha_deploy.model_report import describe_model  # noqa: E402
from mha_deploy.onnx_nodes import all_nodes  # noqa: E402
from tests.conftest import OWN_MODEL_ATOL, OWN_MODEL_RTOL, traces_shared, user_module  # noqa: E402

ENCODER = {"MultiHeadAttention+key_padding_mask": 2}
ENCODER_DECODER = {"MultiHeadAttention+key_padding_mask": 4, "GroupQueryAttention+seqlens_k": 2}
# T5: the position bias stays the op's attention_bias, its padding (and causal) part the op's own inputs;
# cross-attention has no position bias.
T5 = {
    "MultiHeadAttention+attention_bias+key_padding_mask": 2,
    "MultiHeadAttention+attention_bias+causal+key_padding_mask": 2,
    "MultiHeadAttention+key_padding_mask": 2,
}
# (model file, factory) -> the attention ops it fuses into (op+mask inputs -> count)
MODELS = {
    **{("hf_encoder", f"build_{name}{impl}"): ENCODER for name in ("bert", "distilbert", "roberta")
       for impl in ("", "_eager")},
    ("hf_gpt2", "build"): {"GroupQueryAttention+seqlens_k": 2},
    ("hf_gpt2", "build_eager"): {"GroupQueryAttention+seqlens_k": 2},
    **{("hf_seq2seq", f"build_{name}{impl}"): ENCODER_DECODER for name in ("bart", "marian")
       for impl in ("", "_eager")},
    ("hf_seq2seq", "build_t5"): T5,
    ("hf_seq2seq", "build_t5_eager"): T5,
    ("torch_transformer", "build"): ENCODER_DECODER,
    # Its cross-attention reads the sequence itself under the causal mask: GroupQueryAttention as well.
    ("torch_decoder", "build"): {"GroupQueryAttention+seqlens_k": 4},
}
IDS = [f"{name}:{factory}" for name, factory in MODELS]
# Every model here takes at least this many token ids (0 and 1 are pad/bos ids in some).
MIN_VOCAB = 60


@pytest.fixture(scope="module")
def fused_plain(tmp_path_factory):
    """``fused_plain(name, factory) -> (the declared module, its plain graph fused, the fusion report)``: the plain
    graph as ``export --module`` traces it (the same call and arguments: the trace other files' exports of the
    model share, conftest.traces_shared), fused apart from the rest of the export."""
    cache = {}

    def get(name: str, factory: str):
        if (name, factory) not in cache:
            module_file = user_module(name)
            with without_fast_path():  # as export_model declares the module and reads its position tables
                declared = declare_model(getattr(module_file, factory)(), module_file.INPUTS)
                tables = position_tables(declared.wrapper, declared.signature)
            max_length = min((table.max_length for table in tables), default=None)
            with traces_shared(tmp_path_factory, name, factory) as trace, reference_attention():
                plain = trace(declared.traced, declared.signature, declared.d_model, DEFAULT_OPSET,
                              plain_rotary=True, max_length=max_length)
            cache[name, factory] = (declared, *fuse_attention(plain, "mha"))
        return cache[name, factory]

    return get


def _kinds(report) -> dict[str, int]:
    return dict(Counter(
        "+".join([op.op_type.split(".")[-1], *sorted(
            [*op.mask_inputs, *(["causal"] if op.attributes.get("unidirectional") else [])]
        )])
        for op in report.ops
    ))


@pytest.mark.parametrize(("name", "factory"), list(MODELS), ids=IDS)
def test_every_mask_lands_on_its_kernel(fused_plain, name, factory):
    _, fused, report = fused_plain(name, factory)
    assert report.complete, report.summary()
    assert not [node.name for node in all_nodes(fused.graph) if node.op_type == "Softmax"]
    assert _kinds(report) == MODELS[name, factory], report.summary()
    assert report.unrecognised_masks == [] and "materialised)" not in report.summary(), report.summary()
    for op in report.ops:
        if "attention_bias" in op.mask_inputs:
            assert "position bias, additive attention_bias" in op.kernel, op.describe()


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize(("name", "factory"), list(MODELS), ids=IDS)
def test_fused_graph_equals_the_module(fused_plain, name, factory, side):
    declared, fused, _ = fused_plain(name, factory)
    signature = declared.signature
    rng = np.random.default_rng(5)
    lengths = {axis: 11 + 2 * i for i, axis in enumerate(signature.sequence_axes)}  # not the traced lengths
    feeds, real = {}, {}
    for spec in signature.inputs:
        length = lengths[spec.axes[1]]
        if spec.role == "tokens":
            feeds[spec.name] = rng.integers(2, MIN_VOCAB, (3, length))
        else:
            feeds[spec.name] = real[spec.axes[1]] = padding_mask(3, length, side, rng)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    got = ort.InferenceSession(fused.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, feeds
    )
    with torch.no_grad(), without_fast_path():  # as parity runs the module (reference_form)
        want = declared.wrapper(*[torch.from_numpy(feeds[spec.name]) for spec in signature.inputs])
    for spec, fused_out, module_out in zip(signature.outputs, got, want, strict=True):
        rows = real.get(spec.axes[1]) if len(spec.axes) > 2 else None
        module_out = module_out.numpy()
        if rows is not None:  # per-token outputs: real rows only
            fused_out, module_out = fused_out[rows], module_out[rows]
        assert np.isfinite(fused_out).all(), spec.name
        np.testing.assert_allclose(fused_out, module_out, atol=OWN_MODEL_ATOL, rtol=OWN_MODEL_RTOL, err_msg=spec.name)


def test_t5_through_the_cli_reports_its_position_bias(own_model):
    """``export --module`` of T5 (eager): every attention fused, parity passed, nothing reported materialised;
    ``inspect`` names the position bias as a bias."""
    path, output = own_model("hf_seq2seq", "build_t5_eager")
    assert "6 fused" in output and "parity PASSED" in output and "materialised" not in output, output
    kernels = [op.kernel for op in describe_model(path).attention_ops]
    assert sum("position bias, additive attention_bias" in kernel for kernel in kernels) == 4, kernels
    assert not any("mask not recognised" in kernel for kernel in kernels), kernels
