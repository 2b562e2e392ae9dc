"""Two contracts of ``export --hf`` files, without an export: padding masks taken as int64 1/0 (a Hugging Face
tokenizer's ``attention_mask``), cast to bool inside the graph after fusion (``exporters.mask_inputs``); and outputs
spanning the batch (CLIP's ``logits_per_image`` [batch, batch], ``TensorSpec.spans_batch``), which nothing cuts into
items. The Signature says both, the metadata records them in a format older readers refuse, the batch runner's
split leaves spanning outputs out, and the OIP server takes a BOOL tensor for an INT64 mask. The exported files
themselves: tests/exporters/test_hf_folder.py (BERT) and test_hf_encoder_folders.py (CLIP, DeBERTa-v2,
ModernBERT)."""

from __future__ import annotations

import numpy as np
import pytest

from mha_deploy.batch.planner import collate, left_out_note, split_outputs
from mha_deploy.errors import ModelFileError, SignatureError
from mha_deploy.metadata import METADATA_FORMAT, ModelMetadata
from mha_deploy.signature import Signature, TensorSpec

IDS = TensorSpec("input_ids", "tokens", "int64", ("batch", "seq"), vocab=50)
MASK = TensorSpec("attention_mask", "padding_mask", "bool", ("batch", "seq"), marks="input_ids")
PIXELS = TensorSpec("pixel_values", "image", "model", ("batch", 3, 4, 4))
EMBEDS = TensorSpec("text_embeds", "output", "model", ("batch", 8))
HIDDEN = TensorSpec("last_hidden_state", "output", "model", ("batch", "seq", 8))
LOGITS = TensorSpec("logits_per_image", "output", "model", ("batch", "batch"))


def _clip_like(mask_dtype: str = "bool") -> Signature:
    return Signature.custom((IDS, PIXELS, MASK), (LOGITS, EMBEDS, HIDDEN)).with_mask_dtype(mask_dtype)


def test_the_signature_names_the_outputs_spanning_the_batch_and_the_masks_dtype():
    signature = _clip_like("int64")
    assert LOGITS.spans_batch and not EMBEDS.spans_batch and not HIDDEN.spans_batch
    assert signature.batch_outputs == ("logits_per_image",)
    assert [spec.name for spec in signature.item_outputs] == ["text_embeds", "last_hidden_state"]
    assert signature.tensors["attention_mask"].dtype == "int64"
    assert signature.per_token_outputs == ("last_hidden_state",)
    with pytest.raises(SignatureError, match="a padding mask is bool or int64, got 'float32'"):
        signature.with_mask_dtype("float32")
    with pytest.raises(SignatureError, match="a built-in one's are bool"):
        Signature("self", "padding").with_mask_dtype("int64")


@pytest.mark.parametrize(("signature", "written"), [
    (Signature.custom((IDS, MASK), (EMBEDS,)), 2),
    (Signature.custom((IDS, MASK), (EMBEDS,)).with_mask_dtype("int64"), 13),
    (Signature.custom((IDS, PIXELS, MASK), (LOGITS, EMBEDS)), 13),
], ids=["bool-mask", "int64-mask", "spanning-output"])
def test_an_int64_mask_or_a_spanning_output_is_written_in_a_format_older_readers_refuse(signature, written):
    """An older reader would cut logits_per_image into items, and feed bool masks to an int64 one in its load check:
    told to upgrade instead. The record round-trips."""
    raw = ModelMetadata(8, 2, signature).to_json()
    assert f'"format": {written}' in raw
    assert ModelMetadata.from_json(raw).signature == signature
    with pytest.raises(ModelFileError, match="newer than this mha-deploy"):
        ModelMetadata.from_json(raw.replace(f'"format": {written}', f'"format": {METADATA_FORMAT + 1}'))


def test_the_batch_runners_split_leaves_a_spanning_output_out_and_says_why():
    signature = _clip_like("int64")
    rng = np.random.default_rng(0)
    items = [{"input_ids": rng.integers(0, 50, n), "pixel_values": rng.standard_normal((3, 4, 4)).astype(np.float32)}
             for n in (3, 5)]
    batch = collate(items, signature)
    outputs = {"logits_per_image": np.ones((2, 2), np.float32), "text_embeds": np.ones((2, 8), np.float32),
               "last_hidden_state": np.ones((2, 5, 8), np.float32)}
    results = split_outputs(outputs, batch, signature)
    assert [sorted(result) for result in results] == [["last_hidden_state", "text_embeds"]] * 2
    assert results[0]["last_hidden_state"].shape == (3, 8)
    assert left_out_note(signature).startswith("logits_per_image not written: each spans the whole batch")
    assert left_out_note(Signature.custom((IDS, MASK), (EMBEDS,))) is None


def test_the_graph_takes_an_int64_mask_cast_to_bool_once_before_every_reader():
    """A bool-mask graph (Where on the mask, in the main graph and an If branch) rewritten for an int64 mask: the
    input is int64, one Cast feeds both readers, and it computes what the bool graph does."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    from mha_deploy.exporters.mask_inputs import masks_as_declared

    branch = helper.make_graph([helper.make_node("Not", ["attention_mask"], ["flipped"])], "branch", [],
                               [helper.make_tensor_value_info("flipped", TensorProto.BOOL, ["batch", "seq"])])
    graph = helper.make_graph(
        [helper.make_node("Where", ["attention_mask", "x", "zero"], ["kept"]),
         helper.make_node("If", ["always"], ["padded"], then_branch=branch, else_branch=branch)],
        "masked",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.BOOL, ["batch", "seq"])],
        [helper.make_tensor_value_info("kept", TensorProto.FLOAT, ["batch", "seq"]),
         helper.make_tensor_value_info("padded", TensorProto.BOOL, ["batch", "seq"])],
        [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0]), helper.make_tensor("always", TensorProto.BOOL, [],
                                                                                        [True])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    mask = TensorSpec("attention_mask", "padding_mask", "bool", ("batch", "seq"), marks="x")
    signature = Signature.custom((TensorSpec("x", "sequence", "model", ("batch", "seq", 1)), mask), (EMBEDS,))
    assert masks_as_declared(model, signature) is model  # bool declared: left as it is
    rewritten = masks_as_declared(model, signature.with_mask_dtype("int64"))
    onnx.checker.check_model(rewritten, full_check=True)
    assert rewritten.graph.input[1].type.tensor_type.elem_type == TensorProto.INT64
    assert [node.op_type for node in rewritten.graph.node] == ["Cast", "Where", "If"]
    x = np.arange(6, dtype=np.float32).reshape(2, 3) + 1
    mask = np.array([[1, 1, 0], [1, 0, 0]])

    def run(proto, feed_mask):
        session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(None, {"x": x, "attention_mask": feed_mask})

    for got, want in zip(run(rewritten, mask.astype(np.int64)), run(model, mask.astype(bool)), strict=True):
        np.testing.assert_array_equal(got, want)  # exact: a Cast and a Where, no arithmetic


def test_the_oip_server_takes_a_bool_tensor_for_an_int64_mask():
    from mha_deploy.serving.http.parsing import RequestError
    from mha_deploy.serving.http.v2 import check_declared, datatype

    metadata = ModelMetadata(8, 2, Signature.custom((IDS, MASK), (EMBEDS,)).with_mask_dtype("int64"))
    assert datatype(metadata.signature.tensors["attention_mask"], metadata) == "INT64"
    assert check_declared(metadata, "attention_mask", "INT64", [2, 5], 100) == np.dtype(np.int64)
    assert check_declared(metadata, "attention_mask", "BOOL", [2, 5], 100) == np.dtype(bool)
    with pytest.raises(RequestError, match="this model takes INT64"):
        check_declared(metadata, "attention_mask", "FP32", [2, 5], 100)
    bool_file = ModelMetadata(8, 2, Signature.custom((IDS, MASK), (EMBEDS,)))
    with pytest.raises(RequestError, match="this model takes BOOL"):  # a bool file stays as strict as before
        check_declared(bool_file, "attention_mask", "INT64", [2, 5], 100)
