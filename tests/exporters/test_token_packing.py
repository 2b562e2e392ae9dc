"""Token packing (exporters.token_packing): a user's model's per-token ops run on its real tokens only.

Every model of tests/user_models exported packed (the size bound lowered: they are small) equals the module on
real rows, both padding sides, and equals its unpacked export; a wide model is packed by default and a narrow
one is not, saying why; a batch with nothing real, one token, and int8 all run; a pack that fails parity is
dropped with a warning; the CLI and inspect say what was packed. Hugging Face's and torch's own models are
packed and pass parity, every MatMul on tokens packed but those something reads the padded rows of (the pass
says which), and no pack of theirs is dropped by parity; what reads padded rows stops packing, saying so."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from mha_deploy.cli import main  # noqa: E402
from mha_deploy.errors import ParityError  # noqa: E402
from mha_deploy.exporters import export, export_model, token_packing  # noqa: E402
from mha_deploy.inputs import InputCase, make_inputs, real_rows  # noqa: E402
from mha_deploy.model_report import describe_model  # noqa: E402
from mha_deploy.runtime import MHASession  # noqa: E402
from tests.conftest import USER_MODELS, assert_equals_module, module_feeds, user_module  # noqa: E402

MODELS = ["classifier", "causal_lm", "seq2seq", "feature_encoder", "torch_encoder", "sdpa_classifier", "swiglu_tagger"]


@pytest.fixture
def pack_any_size(monkeypatch):
    """The test models are too narrow for packing to pay: pack them anyway."""
    monkeypatch.setattr(token_packing, "MIN_WORK_PER_COPIED_ELEMENT", 0)


def _export(shared_trace, tmp_path, name: str, *args: str):
    path = tmp_path / f"{name}{''.join(args)}.onnx"
    inputs = [arg for spec in user_module(name).INPUTS for arg in ("--input", spec)]
    with shared_trace(name, "build"):  # one trace of the model for every export of it (the flags act after it)
        result = CliRunner().invoke(
            main, ["export", "--module", f"{USER_MODELS / name}.py:build", *inputs, *args, "-o", str(path)])
    assert result.exit_code == 0, result.output
    return path, result.output


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_packed_models_equal_the_module_and_their_unpacked_export(shared_trace, tmp_path, pack_any_size, name):
    path, output = _export(shared_trace, tmp_path, name)
    assert "warning" not in output, output
    # every dense layer runs packed: each MatMul of the model's graph (the attentions' own are in their ops)
    matmuls = sum(node.op_type == "MatMul" for node in onnx.load(str(path)).graph.node)
    assert f"token packing: {matmuls} MatMul(s) and " in output, output
    unpacked_path, unpacked_output = _export(shared_trace, tmp_path, name, "--no-pack-tokens")
    assert "token packing" not in unpacked_output
    packed, unpacked = MHASession(path, provider="cpu"), MHASession(unpacked_path, provider="cpu")
    module = user_module(name).build()
    for side in ("right", "left", "mixed"):
        lengths = {axis: 29 + 7 * i for i, axis in enumerate(packed.signature.sequence_axes)}
        feeds = module_feeds(packed, 4, lengths, side, seed=3)
        assert_equals_module(packed, module, feeds, f"{name} packed ({side} padding)")
        got, want = packed.run(feeds), unpacked.run(feeds)
        for output_name in packed.signature.output_names:
            have, expected = got[output_name], want[output_name]
            assert have.shape == expected.shape
            if output_name in packed.signature.per_token_outputs:
                assert np.isfinite(have).all(), f"{name} {output_name}: padded rows not finite"
                real = real_rows(packed.signature, feeds)[packed.signature.tensors[output_name].axes[1]]
                have, expected = have[real], expected[real]
            np.testing.assert_allclose(have, expected, atol=1e-5, rtol=1e-4, err_msg=f"{name} {side}")


def test_a_wide_model_is_packed_by_default_and_a_narrow_one_says_why(shared_trace, tmp_path):
    classifier = user_module("classifier")
    torch.manual_seed(0)
    wide = classifier.TextClassifier(d_model=256, num_heads=4, num_layers=1)
    with shared_trace("classifier", "build_wide"):  # the same seed and sizes
        result = export_model(wide, tmp_path / "wide.onnx", classifier.INPUTS)
    assert result.packing is not None and result.packing.runs == 1, result.packing
    # q, k, v, the output projection and two feed-forward layers; the attention itself stays in place
    assert result.packing.matmuls == 6 and result.packing.masks == ["attention_mask"]
    assert result.parity.passed and not result.warnings
    text = describe_model(tmp_path / "wide.onnx").text()
    assert "  packed 6 MatMul(s)" in text and "attention_mask" in text

    with shared_trace("classifier", "build"):
        narrow = export_model(classifier.build(), tmp_path / "narrow.onnx", classifier.INPUTS)
    assert narrow.packing is not None and narrow.packing.runs == 0
    assert "too small" in narrow.packing.describe() and "below 500" in narrow.packing.describe()
    assert "\n  packed " not in describe_model(tmp_path / "narrow.onnx").text()


def test_only_axes_the_model_may_be_padded_on_are_packed(tmp_path, pack_any_size):
    class _UnmaskedMean(torch.nn.Module):
        """Reads its padding: the mean over every position, real or not."""

        def __init__(self):
            super().__init__()
            self.embed, self.ff = torch.nn.Embedding(20, 16), torch.nn.Linear(16, 16)

        def forward(self, ids, mask):
            return self.ff(self.embed(ids)).mean(dim=1)

    result = export_model(_UnmaskedMean(), tmp_path / "m.onnx", ["ids:tokens", "mask:padding-mask"])
    assert result.metadata.signature.paddable_axes == frozenset()
    assert result.packing is None


def test_int8_packs_and_passes_its_parity_budget(shared_trace, tmp_path, pack_any_size):
    classifier = user_module("classifier")
    # int8's dynamic quantization scales each MatMul input over its rows: packed, over the real ones only, so
    # packed and unpacked int8 differ within the int8 budget, not bit for bit.
    with shared_trace("classifier", "build"):
        result = export_model(classifier.build(), tmp_path / "m.onnx", classifier.INPUTS, quantize="int8-dynamic")
    assert result.packing.runs == 1 and result.parity.passed and not result.warnings
    assert result.parity.rel_budget is not None


def test_edge_batches_run_packed(shared_trace, tmp_path, pack_any_size):
    classifier = user_module("classifier")
    with shared_trace("classifier", "build"):
        result = export_model(classifier.build(), tmp_path / "m.onnx", classifier.INPUTS)
        unpacked = export_model(classifier.build(), tmp_path / "u.onnx", classifier.INPUTS, pack_tokens=False)
    assert result.packing.runs == 1 and result.parity.passed and not result.warnings
    assert unpacked.packing is None
    # ONNX Runtime itself, as a user of the bare file would: MHASession refuses rows without a real token.
    packed, plain = (ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
                     for path in (result.path, unpacked.path))
    two = np.array([[3, 4, 5], [6, 7, 8]])
    for ids, mask in ((two, np.zeros((2, 3), bool)), (two, np.array([[True, False, False], [False] * 3])),
                      (np.array([[9]]), np.ones((1, 1), bool))):
        feeds = {"input_ids": ids, "attention_mask": mask}
        (got,), (want,) = packed.run(None, feeds), plain.run(None, feeds)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4, err_msg=str(mask))


def test_a_pack_that_fails_parity_is_dropped_with_a_warning(shared_trace, tmp_path, pack_any_size, monkeypatch):
    def broken(model, masks, rows_only=None):
        packed, report = token_packing.pack_model(model, masks, rows_only)
        # a wrong graph: the first output doubled
        graph = packed.graph
        name = graph.output[0].name
        graph.node.extend([onnx.helper.make_node("Add", [f"{name}_wrong", f"{name}_wrong"], [name])])
        for node in graph.node[:-1]:
            node.output[:] = [f"{name}_wrong" if out == name else out for out in node.output]
        return packed, report

    monkeypatch.setattr(export, "pack_model", broken)
    classifier = user_module("classifier")
    with shared_trace("classifier", "build"):
        result = export_model(classifier.build(), tmp_path / "m.onnx", classifier.INPUTS)
    assert result.parity.passed and result.metadata.fusion == "mha"
    assert result.packing is None
    assert any(w.startswith("token packing not used (parity FAILED") for w in result.warnings), result.warnings


# --fuse onnx is the target for CUDA graphs, which replay fixed shapes: it is never packed.
@pytest.mark.parametrize(("fuse", "packed"), [("auto", True), ("onnx", False)])
def test_the_cli_says_what_was_packed(shared_trace, tmp_path, pack_any_size, fuse, packed):
    path, output = _export(shared_trace, tmp_path, "classifier", "--fuse", fuse)
    assert ("token packing: 12 MatMul(s)" in output) == packed, output
    assert "parity PASSED" in output and "warning" not in output
    session = MHASession(path, provider="cpu")
    feeds = module_feeds(session, 3, {"seq": 19}, "left", seed=5)
    assert_equals_module(session, user_module("classifier").build(), feeds, f"classifier --fuse {fuse}")



@pytest.mark.parametrize("model", ["encoder", "decoder"])
def test_the_built_in_stacks_are_packed_like_a_users_model(tmp_path, model):
    """The stacks are wide enough by default (d_model 256 here): packed, and equal to their unpacked export on
    the real rows of a padded batch. One layer: at d_model 256 its runs of per-token ops already pay for their
    copies, and a second layer would add to these four exports' tracing without a new kind of op to pack."""
    paths = {}
    for flag in ("--pack-tokens", "--no-pack-tokens"):
        paths[flag] = tmp_path / f"{model}{flag}.onnx"
        result = CliRunner().invoke(main, ["export", "--model", model, "--layers", "1", "--d-model", "256",
                                           "--heads", "4", "--mask", "padding", flag, "-o", str(paths[flag])])
        assert result.exit_code == 0, result.output
        assert ("run on the real tokens of key_padding_mask" in result.output) == (flag == "--pack-tokens")
    packed, unpacked = (MHASession(path, provider="cpu") for path in paths.values())
    feeds = make_inputs(packed.signature, 256, InputCase(3, 21, 13, "mixed"), seed=4)
    got, want = packed.run(feeds), unpacked.run(feeds)
    real = feeds["key_padding_mask"]
    for name in packed.signature.output_names:
        np.testing.assert_allclose(got[name][real], want[name][real], atol=1e-5, rtol=1e-4, err_msg=name)


class _AnnotatedLayerNorm(torch.nn.Module):
    """The Annotated Transformer's LayerNorm, written out: reductions over the last axis."""

    def __init__(self, features, eps=1e-6):
        super().__init__()
        self.a_2 = torch.nn.Parameter(torch.ones(features))
        self.b_2 = torch.nn.Parameter(torch.zeros(features))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)
        return self.a_2 * (x - mean) / (std + self.eps) + self.b_2


def test_norms_written_out_run_packed(tmp_path, pack_any_size):
    classifier = user_module("classifier")
    model = classifier.build()
    for block in model.blocks:
        block.norm1, block.norm2 = _AnnotatedLayerNorm(32), _AnnotatedLayerNorm(32)
    result = export_model(model, tmp_path / "m.onnx", classifier.INPUTS)
    assert result.packing.runs == 1 and result.parity.passed and not result.warnings
    graph = onnx.load(str(result.path)).graph
    first_dims = {info.name: info.type.tensor_type.shape.dim[0].dim_param for info in graph.value_info
                  if info.type.tensor_type.shape.dim}
    reductions = [node for node in graph.node if node.op_type == "ReduceMean"]
    assert reductions and all(first_dims.get(node.input[0]) == "attention_mask_packed" for node in reductions)


def test_the_pass_names_nothing_as_the_model_already_does(shared_trace, tmp_path, pack_any_size):
    """A graph from elsewhere may hold values named as the pass names its own (packing_0, ...)."""
    import onnx_ir as ir

    classifier = user_module("classifier")
    with shared_trace("classifier", "build"):
        fused = export_model(classifier.build(), tmp_path / "fused.onnx", classifier.INPUTS, pack_tokens=False)
    model = ir.load(str(fused.path))
    for number, node in enumerate(list(model.graph)[:60]):
        for value in node.outputs:
            if not value.is_graph_output():
                value.name = f"packing_{number}"
    packed, report = token_packing.pack_model(ir.to_proto(model), ["attention_mask"])
    assert report.runs == 1
    feeds = {"input_ids": np.arange(10).reshape(2, 5), "attention_mask": np.array([[1, 1, 1, 0, 0], [1] * 5], bool)}
    (got,) = ort.InferenceSession(packed.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    (want,) = ort.InferenceSession(str(fused.path), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


# Models as people write them, packed and equal to the module (parity at export, both padding sides), and how
# many of their MatMuls (and Gemms) cannot run on real tokens only. A pack that parity drops is a defect of the
# analysis, never an outcome; a model it refuses says why (test_what_reads_padded_rows_stops_packing...).
# (file, factory, MatMuls not on tokens or left unpacked, why ops were left unpacked)
PEOPLES_MODELS = [
    ("hf_encoder", "build_distilbert", 0, None),
    ("hf_encoder", "build_distilbert_eager", 0, None),
    # The pooler reads position 0, padded under left padding: packed in every row; its dense layer has one row
    # per item.
    ("hf_encoder", "build_bert", 1, None),
    ("hf_encoder", "build_bert_eager", 1, None),
    # And its position ids are a cumulative sum over input_ids != pad: the ops before it stay unpacked.
    ("hf_encoder", "build_roberta", 1, "CumSum node_cumsum reads padded rows"),
    ("hf_encoder", "build_roberta_eager", 1, "CumSum node_cumsum reads padded rows"),
    ("hf_gpt2", "build", 0, None),
    ("hf_gpt2", "build_eager", 0, None),
    # The encoder's states are an output along the source axis, compared on the source's real rows (as the
    # runners return them): encoder and decoder are packed, each by its own mask. One attention form each: the
    # eager and sdpa forms fuse to the same ops before packing (tests/exporters/fusion/test_user_model_masks.py),
    # and each of these exports costs 15-30 s.
    ("hf_seq2seq", "build_bart", 0, None),
    ("hf_seq2seq", "build_marian_eager", 0, None),
    ("hf_seq2seq", "build_t5", 0, None),
    ("torch_transformer", "build", 0, None),
    ("torch_decoder", "build", 0, None),
]


@pytest.fixture(scope="session")
def peoples_export(tmp_path_factory, shared_trace):
    """``peoples_export(file, factory)`` -> the ExportResult of tests/user_models/<file>.py's factory, packed at
    any size, once per session (its trace shared with the model's other exports: conftest.traces_shared)."""
    cache = {}

    def export_(name: str, factory: str):
        if (name, factory) not in cache:
            module = user_module(name)
            model = getattr(module, factory)()
            path = tmp_path_factory.mktemp("peoples") / f"{name}_{factory}.onnx"
            saved = token_packing.MIN_WORK_PER_COPIED_ELEMENT
            token_packing.MIN_WORK_PER_COPIED_ELEMENT = 0
            try:
                with shared_trace(name, factory):
                    cache[name, factory] = export_model(model, path, module.INPUTS)
            except ParityError as error:
                cache[name, factory] = error
            finally:
                token_packing.MIN_WORK_PER_COPIED_ELEMENT = saved
        result = cache[name, factory]
        if isinstance(result, ParityError):
            assert "non-finite" in str(result), result
            pytest.skip(f"the unpacked export fails parity too: a fully masked row is NaN ({result})")
        return result

    return export_


@pytest.mark.slow
@pytest.mark.parametrize(("name", "factory", "unpacked_matmuls", "why_unpacked"), PEOPLES_MODELS,
                         ids=[f"{name}:{factory}" for name, factory, *_ in PEOPLES_MODELS])
def test_peoples_models_are_packed_and_equal_to_the_module(peoples_export, name, factory, unpacked_matmuls,
                                                           why_unpacked):
    result = peoples_export(name, factory)
    assert result.parity.passed
    assert not any(warning.startswith("token packing not used") for warning in result.warnings), result.warnings
    if result.metadata.fusion == "none":
        # unfused (an attention no rule knows yet): packing is for fused graphs only
        assert result.packing is None
        return
    assert (why_unpacked is None) == (not result.packing.unpacked), result.packing.describe()
    assert why_unpacked is None or why_unpacked in result.packing.unpacked, result.packing.describe()
    if name == "hf_seq2seq":  # the encoder by the source's mask, the decoder by the target's
        assert result.packing.masks == ["attention_mask", "decoder_attention_mask"], result.packing.describe()
    if name == "hf_encoder" and "distilbert" not in factory:
        assert "position 0 of attention_mask's rows (Gather node_select reads it)" in result.packing.describe()
    # every dense layer on tokens runs packed: each MatMul and Gemm of the graph (the attentions' own are in
    # their ops) but those named
    graph = onnx.load(str(result.path)).graph
    assert result.packing.runs and result.packing.matmuls == sum(
        node.op_type in ("MatMul", "Gemm") for node in graph.node) - unpacked_matmuls, result.packing.describe()


@pytest.mark.slow
def test_gpt2s_rows_go_back_in_one_gather_each(peoples_export):
    """GPT-2's fused q, k, v projection is split packed; its head views reach attentions only and its logits
    are an output, so each is put back by one Gather of [batch, seq] rows (the spare row at padded positions):
    no zero row padded on, no Reshape after it (ORT copies a Reshape that is a model output: a whole logits
    tensor)."""
    result = peoples_export("hf_gpt2", "build")
    graph = onnx.load(str(result.path)).graph
    producers = {output: node for node in graph.node for output in node.output}
    assert producers["logits"].op_type == "Gather", producers["logits"]
    assert not [node.name for node in graph.node if node.op_type == "Pad"]
    first_dims = {info.name: info.type.tensor_type.shape.dim[0].dim_param for info in graph.value_info
                  if info.type.tensor_type.shape.dim}
    splits = [node for node in graph.node if node.op_type == "Split"]
    assert splits and all(first_dims.get(node.input[0]) == "attention_mask_packed" for node in splits)


class _RunningSum(torch.nn.Module):
    """A feed-forward, then a cumulative sum along the sequence: under left padding its real rows add up the
    padded rows before them."""

    def __init__(self):
        super().__init__()
        self.embed, self.ff = torch.nn.Embedding(20, 16), torch.nn.Linear(16, 16)

    def forward(self, ids, mask):
        return self.ff(self.embed(ids)).cumsum(dim=1)


def test_what_reads_padded_rows_stops_packing_and_the_export_says_which(tmp_path, pack_any_size):
    result = export_model(_RunningSum(), tmp_path / "m.onnx", ["ids:tokens", "mask:padding-mask"])
    assert result.parity.passed and not result.warnings
    assert result.packing.runs == 0 and "CumSum" in result.packing.reason and "reads padded rows" in (
        result.packing.reason), result.packing.describe()


class _Pooled(torch.nn.Module):
    """A feed-forward, then its first position, as BERT's pooler reads it."""

    def __init__(self):
        super().__init__()
        self.embed, self.ff = torch.nn.Embedding(20, 16), torch.nn.Linear(16, 16)

    def forward(self, ids, mask):
        h = self.ff(self.embed(ids))
        return torch.tanh(h[:, 0])


def test_positions_a_gather_reads_are_packed_in_every_row(tmp_path, pack_any_size):
    result = export_model(_Pooled(), tmp_path / "m.onnx", ["ids:tokens", "mask:padding-mask"])
    assert result.parity.passed and not result.warnings
    text = result.packing.describe()
    assert result.packing.runs == 1 and result.packing.matmuls == 1, text
    assert "position 0 of mask's rows (Gather " in text
