"""Signature.custom: a user's model's declared tensors, read back from the file's metadata as they were."""

from __future__ import annotations

import json

import pytest

from mha_deploy.errors import ModelFileError, SignatureError
from mha_deploy.metadata import (
    CACHE_HOLES,
    CACHE_RAGGED,
    METADATA_FORMAT,
    GenerationIds,
    ModelMetadata,
    ParityReport,
    WeightOnlyRecord,
)
from mha_deploy.signature import Signature, TensorSpec

IDS = TensorSpec("src", "tokens", "int64", ("batch", "src_seq"), vocab=40)
SRC_MASK = TensorSpec("src_mask", "padding_mask", "bool", ("batch", "src_seq"), marks="src")
TGT = TensorSpec("tgt", "tokens", "int64", ("batch", "tgt_seq"), vocab=50)
LOGITS = TensorSpec("logits", "output", "model", ("batch", "tgt_seq", 50))
POOLED = TensorSpec("pooled", "output", "model", ("batch", 8))
SEGMENT_IDS = TensorSpec("segments", "segments", "int64", ("batch", "src_seq"), vocab=2)
IMAGE = TensorSpec("pixel_values", "image", "model", ("batch", 3, 32, 32))
AUDIO = TensorSpec("input_features", "audio", "model", ("batch", 80, 3000))


def test_a_custom_signature_survives_the_files_metadata():
    signature = Signature.custom((IDS, SRC_MASK, TGT), (LOGITS, POOLED), ("src_seq",))
    back = ModelMetadata.from_json(ModelMetadata(32, 4, signature).to_json()).signature
    assert back == signature
    assert back.query_axis == "tgt_seq" and back.sequence_axes == ("tgt_seq", "src_seq")
    assert back.padding_masks == {"src_mask": "src"} and back.per_token_outputs == ("logits",)
    assert back.paddable_axes == frozenset({"src_seq"})
    assert LOGITS.dims({}) == (-1, -1, 50) and IDS.item_shape(7, {}) == (7,)


@pytest.mark.parametrize(("max_length", "written_format"), [(None, 2), (512, 3)], ids=["custom", "max-length"])
def test_an_older_reader_is_told_to_upgrade(max_length, written_format):
    raw = ModelMetadata(32, 4, Signature.custom((IDS,), (POOLED,)), max_length=max_length).to_json()
    assert f'"format": {written_format}' in raw and ('"max_length"' in raw) == (max_length is not None)
    with pytest.raises(ModelFileError, match="newer than this mha-deploy"):
        ModelMetadata.from_json(raw.replace(f'"format": {written_format}', f'"format": {METADATA_FORMAT + 1}'))


@pytest.mark.parametrize("per_row", [False, True], ids=["absolute", "per-row"])
def test_a_parity_report_keeps_whether_its_atol_is_per_row(per_row):
    parity = ParityReport(True, 1e-5, 1e-4, 1e-6, 1e-7, 0.0, atol_per_row=per_row)
    raw = ModelMetadata(32, 4, Signature.custom((IDS,), (POOLED,)), parity=parity).to_json()
    # Files before per-row atol hold absolute ones and no such key; a per-row report needs format 4.
    assert ('"atol_per_row"' in raw) == per_row and (f'"format": {4 if per_row else 2}' in raw)
    back = ModelMetadata.from_json(raw).parity
    assert back.atol_per_row == per_row
    assert ("atol=1e-05 x row scale rtol=0.0001" in back.summary()) == per_row


def test_the_max_length_survives_the_files_metadata():
    metadata = ModelMetadata(32, 4, Signature.custom((IDS,), (POOLED,)), max_length=512)
    assert ModelMetadata.from_json(metadata.to_json()).max_length == 512


def test_generation_ids_survive_the_files_metadata_in_format_5_and_a_file_without_them_stays_older():
    ids = GenerationIds([2, 7], pad_token_id=0, decoder_start_token_id=1)
    raw = ModelMetadata(32, 4, Signature.custom((IDS,), (POOLED,)), generation=ids).to_json()
    assert '"format": 5' in raw
    assert ModelMetadata.from_json(raw).generation == ids
    # A decoder-only model's bos id (for onnxruntime-genai's config): kept, and written only when there is one.
    assert '"bos_token_id"' not in raw
    with_bos = GenerationIds([2], bos_token_id=3)
    raw_bos = ModelMetadata(32, 4, Signature.custom((IDS,), (POOLED,)), generation=with_bos).to_json()
    assert ModelMetadata.from_json(raw_bos).generation == with_bos
    assert '"format": 11' in raw_bos  # an older reader is told to upgrade, not that the metadata is unreadable
    plain = ModelMetadata(32, 4, Signature.custom((IDS,), (POOLED,))).to_json()
    assert '"generation"' not in plain and '"format": 2' in plain  # readable by the mha-deploy before it
    assert ModelMetadata.from_json(plain).generation is None


@pytest.mark.parametrize("positions", ["input", "none", "padded-width"])
def test_how_positions_work_survives_the_files_metadata_in_format_6(positions):
    raw = ModelMetadata(32, 4, Signature.custom((IDS,), (POOLED,)), positions=positions).to_json()
    assert '"format": 6' in raw
    assert ModelMetadata.from_json(raw).positions == positions
    plain = ModelMetadata(32, 4, Signature.custom((IDS,), (POOLED,))).to_json()
    assert '"positions"' not in plain and ModelMetadata.from_json(plain).positions is None


@pytest.mark.parametrize("layout", [CACHE_RAGGED, CACHE_HOLES])
def test_a_cache_layout_survives_the_files_metadata_in_format_7(layout):
    raw = ModelMetadata(32, 4, Signature.custom((IDS,), (POOLED,)), positions="input", cache_layout=layout).to_json()
    assert '"format": 7' in raw
    assert ModelMetadata.from_json(raw).cache_layout == layout
    # none recorded (earlier files, and holes files written for the mha-deploy before it): holes
    plain = ModelMetadata(32, 4, Signature.custom((IDS,), (POOLED,)), positions="input").to_json()
    assert '"cache_layout"' not in plain and '"format": 6' in plain
    assert ModelMetadata.from_json(plain).cache_layout is None


def test_a_cache_layout_of_no_known_kind_is_refused_naming_the_file():
    raw = json.loads(ModelMetadata(32, 4, Signature.custom((IDS,), (POOLED,)), cache_layout=CACHE_RAGGED).to_json())
    raw["cache_layout"] = "paged"
    with pytest.raises(ModelFileError, match=r"lm\.onnx: .*cache_layout is 'paged', not one of ragged, holes"):
        ModelMetadata.from_json(json.dumps(raw), "lm.onnx")


def test_positions_of_no_known_kind_are_refused_naming_the_file():
    raw = json.loads(ModelMetadata(32, 4, Signature.custom((IDS,), (POOLED,)), positions="input").to_json())
    raw["positions"] = "rotary"
    with pytest.raises(ModelFileError, match=r"lm\.onnx: .*positions is 'rotary', not one of input, none"):
        ModelMetadata.from_json(json.dumps(raw), "lm.onnx")


@pytest.mark.parametrize("value", [{"eos_token_ids": ["2"]}, {"pad_token_id": -1}, {"pad_token_id": 1.5},
                                   {"eos_token_ids": 2}, {"bos": 3}])
def test_generation_ids_that_are_no_token_ids_are_refused_naming_the_file(value):
    raw = json.loads(ModelMetadata(32, 4, Signature.custom((IDS,), (POOLED,)), generation=GenerationIds([2])).to_json())
    raw["generation"] = value
    with pytest.raises(ModelFileError, match=r"lm\.onnx"):
        ModelMetadata.from_json(json.dumps(raw), "lm.onnx")


@pytest.mark.parametrize("value", ["512", 0, -3, 1.5])
def test_a_max_length_that_is_no_positive_integer_is_refused(value):
    raw = ModelMetadata(32, 4, Signature.custom((IDS,), (POOLED,)), max_length=512).to_json()
    with pytest.raises(ModelFileError, match=r"max_length .* not a positive integer"):
        ModelMetadata.from_json(raw.replace('"max_length": 512', f'"max_length": {json.dumps(value)}'))


@pytest.mark.parametrize(
    ("inputs", "outputs", "paddable", "message"),
    [
        ((SRC_MASK,), (POOLED,), (), "at least one tokens, sequence, image or audio input"),
        ((SEGMENT_IDS,), (POOLED,), (), "at least one tokens, sequence, image or audio input"),
        ((TGT, SEGMENT_IDS), (POOLED,), (), "segments: segment ids mark the positions of a tokens input"),
        ((TensorSpec("pixel_values", "image", "model", ("batch", 3, "h", 32)),), (POOLED,), (),
         r"pixel_values: an image input is \[batch, channels"),
        ((TensorSpec("input_features", "audio", "model", ("batch", 80)),), (POOLED,), (), r"\[batch, mel, frames\]"),
        ((IDS, SRC_MASK), (), (), "at least one output"),
        ((TGT, SRC_MASK), (POOLED,), (), "src_mask: a padding mask marks"),
        ((IDS, IDS), (POOLED,), (), "src is declared twice"),
        ((IDS,), (POOLED,), ("tgt_seq",), "not length axes"),
    ],
)
def test_impossible_declarations_are_refused(inputs, outputs, paddable, message):
    with pytest.raises(SignatureError, match=message):
        Signature.custom(inputs, outputs, paddable)


def test_segments_images_and_audio_survive_the_files_metadata_in_format_9():
    """Inputs of the roles an earlier mha-deploy does not know: it is told to upgrade (format 9), and they come back
    as declared; images and audio have no length axis (nothing to pad), segment ids ride on their tokens' axis."""
    for inputs in ((IDS, SRC_MASK, SEGMENT_IDS), (IMAGE,), (AUDIO,)):
        signature = Signature.custom(inputs, (POOLED,), ("src_seq",) if inputs[0] is IDS else ())
        raw = ModelMetadata(32, 4, signature).to_json()
        assert '"format": 9' in raw
        back = ModelMetadata.from_json(raw).signature
        assert back == signature
    image = Signature.custom((IMAGE,), (POOLED,))
    assert image.sequence_inputs == () and image.item_inputs == image.fixed_shape_inputs == ("pixel_values",)
    assert image.query_axis is None and image.query_input == "pixel_values" and image.sequence_axes == ()
    assert IMAGE.sequence_axis is None and IMAGE.item_shape(7, {}) == (3, 32, 32) and IMAGE.dims({}) == (-1, 3, 32, 32)
    pair = Signature.custom((IDS, SRC_MASK, SEGMENT_IDS), (POOLED,), ("src_seq",))
    assert pair.sequence_inputs == ("src", "segments") and pair.padding_masks == {"src_mask": "src"}


def test_weight_only_quantization_and_its_quality_survive_the_files_metadata_in_format_8():
    record = WeightOnlyRecord(4, 32, False, "rtn", 4, matmuls=13, fp32_matmuls=1, head_fp32=True)
    parity = ParityReport(True, 1e-5, 1e-4, 0.3, 0.2, 0.0, rel_err=0.065, rel_budget=0.25, top1_agreement=0.9,
                          top1_rows=120)
    raw = ModelMetadata(32, 4, Signature.custom((IDS,), (POOLED,)), quantization="int4", weight_only=record,
                        parity=parity).to_json()
    assert '"format": 8' in raw
    back = ModelMetadata.from_json(raw)
    assert (back.quantization, back.weight_only, back.parity) == ("int4", record, parity)
    assert "top-1 agreement 90.0% over 120 rows" in back.parity.summary()


def test_an_int8_file_from_before_weight_only_int8_reads_as_the_dynamic_path():
    """Before format 8, "int8" was dynamic int8 (MatMulInteger): such a file loads as int8-dynamic, and an fp32
    report without top-1 keeps the older format."""
    raw = ModelMetadata(32, 4, Signature(), quantization="int8").to_json()
    assert '"format": 1' in raw and '"int8"' in raw
    assert ModelMetadata.from_json(raw).quantization == "int8-dynamic"


@pytest.mark.parametrize(("quantization", "words"), [("int4", "quantization int4 lacks its weight-only record"),
                                                     ("int3", "quantization is 'int3', not one of")])
def test_a_quantization_the_file_cannot_back_is_refused_naming_the_file(quantization, words):
    raw = json.loads(ModelMetadata(32, 4, Signature()).to_json())
    raw["quantization"] = quantization
    with pytest.raises(ModelFileError, match=rf"q\.onnx: .*{words}"):
        ModelMetadata.from_json(json.dumps(raw), "q.onnx")


def test_a_relative_budget_failure_says_by_how_much():
    parity = ParityReport(False, 1e-5, 1e-4, 0.3, 0.2, 0.0, shapes=["1x1"], rel_err=0.5, rel_budget=0.25)
    assert "relative error 50.000% (budget 25.0%: 2.0x the budget)" in parity.summary()
