"""The one validator on inputs beyond token ids: segment ids past their own table, images and audio of another
size, each refused in words naming the input and its bound, for a batch (``validate_inputs``, what MHASession
runs) and for one item (``item_problem``, what infer and serve run); and the exported files refuse the same."""

from __future__ import annotations

import numpy as np
import pytest

from mha_deploy.errors import InputError
from mha_deploy.metadata import ModelMetadata, Signature
from mha_deploy.runtime.validation import item_problem, validate_inputs
from mha_deploy.signature import TensorSpec

IDS = TensorSpec("input_ids", "tokens", "int64", ("batch", "seq"), vocab=96)
MASK = TensorSpec("attention_mask", "padding_mask", "bool", ("batch", "seq"), marks="input_ids")
SEGMENTS = TensorSpec("token_type_ids", "segments", "int64", ("batch", "seq"), vocab=2)
IMAGE = TensorSpec("pixel_values", "image", "model", ("batch", 3, 32, 32))
AUDIO = TensorSpec("input_features", "audio", "model", ("batch", 8, 32))
OUT = TensorSpec("pooled", "output", "model", ("batch", 32))

PAIR = ModelMetadata(32, 4, Signature.custom((IDS, MASK, SEGMENTS), (OUT,), ("seq",)))
VISION = ModelMetadata(32, 4, Signature.custom((IMAGE,), (OUT,)))
SPEECH = ModelMetadata(32, 4, Signature.custom((AUDIO,), (OUT,)))


def _pair(segments: np.ndarray) -> dict[str, np.ndarray]:
    batch, seq = segments.shape
    return {"input_ids": np.ones((batch, seq), np.int64), "attention_mask": np.ones((batch, seq), bool),
            "token_type_ids": segments}


@pytest.mark.parametrize(("bad", "bound"), [(2, "0 to 1"), (5, "0 to 1"), (-1, "0 to 1")])
def test_a_segment_id_past_its_table_is_refused_naming_input_and_bound(bad, bound):
    segments = np.zeros((2, 4), np.int64)
    segments[1, 2] = bad
    with pytest.raises(InputError, match=rf"token_type_ids holds id {bad}: .*2 rows.*segment ids are {bound}"):
        validate_inputs(PAIR, _pair(segments))
    problem = item_problem(PAIR, {"input_ids": np.ones(4, np.int64), "token_type_ids": segments[1]})
    assert problem.kind == "id_out_of_range" and f"token_type_ids holds id {bad}" in problem.message


def test_segment_ids_within_their_table_pass_and_padding_is_inert():
    segments = np.array([[0, 1, 1, 0], [1, 1, 7, 7]])  # row 1's last two positions are padding
    feeds = _pair(segments)
    feeds["attention_mask"][1, 2:] = False
    checked = validate_inputs(PAIR, feeds)
    assert checked["token_type_ids"].tolist() == [[0, 1, 1, 0], [1, 1, 0, 0]]


def test_segment_ids_must_be_integers_of_their_tokens_length():
    with pytest.raises(InputError, match="token_type_ids holds segment ids: it must be an integer array"):
        validate_inputs(PAIR, _pair(np.zeros((2, 4), np.float32)))
    with pytest.raises(InputError, match="input_ids and token_type_ids must have the same length, got 4 and 3"):
        validate_inputs(PAIR, {**_pair(np.zeros((2, 4), np.int64)), "token_type_ids": np.zeros((2, 3), np.int64)})


@pytest.mark.parametrize(("metadata", "shape", "words"), [
    (VISION, (3, 16, 32), r"pixel_values has height 16 \(expected 32\): this model takes images of \[channels, "
                          r"height, width\] = \[3, 32, 32\]"),
    (VISION, (1, 32, 32), r"pixel_values has channels 1 \(expected 3\)"),
    (VISION, (3, 64, 48), r"height 64 \(expected 32\), width 48 \(expected 32\)"),
    (VISION, (32, 32), r"pixel_values has shape \(32, 32\): one image is \[channels, height, width\] = \[3, 32, 32\]"),
    (SPEECH, (8, 3000), r"input_features has frames 3000 \(expected 32\): .*\[mel, frames\] = \[8, 32\]; pad or cut"),
    (SPEECH, (80, 32), r"input_features has mel 80 \(expected 8\)"),
], ids=["height", "channels", "both", "rank", "frames", "mel"])
def test_an_image_or_audio_of_another_size_is_refused_naming_expected_and_got(metadata, shape, words):
    name = metadata.signature.input_names[0]
    with pytest.raises(InputError, match=words):
        validate_inputs(metadata, {name: np.zeros((2, *shape), np.float32)})
    problem = item_problem(metadata, {name: np.zeros(shape, np.float32)})
    assert problem.kind in ("wrong_shape", "wrong_rank")
    assert problem.message.startswith(f"{name} has ")


@pytest.mark.parametrize("metadata", [VISION, SPEECH], ids=["image", "audio"])
def test_images_and_audio_stack_in_the_models_dtype_finite(metadata):
    spec = metadata.signature.inputs[0]
    good = np.ones((3, *spec.axes[1:]), np.float32)
    assert validate_inputs(metadata, {spec.name: good})[spec.name].shape == good.shape
    assert item_problem(metadata, {spec.name: good[0]}) is None
    with pytest.raises(InputError, match=f"{spec.name} must be float32, got float64"):
        validate_inputs(metadata, {spec.name: good.astype(np.float64)})
    bad = good.copy()
    bad[1, 0, 0] = np.nan
    with pytest.raises(InputError, match=f"{spec.name} contains NaN or Inf"):
        validate_inputs(metadata, {spec.name: bad})
    assert item_problem(metadata, {spec.name: bad[1]}).kind == "not_finite"
    with pytest.raises(InputError, match=f"{spec.name} is empty"):
        validate_inputs(metadata, {spec.name: good[:0]})


# --- the exported files -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sessions(own_model):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from mha_deploy.runtime import MHASession

    return lambda file: MHASession(own_model(file)[0], provider="cpu")


def test_the_bert_file_refuses_segment_id_2_on_its_2_row_table(sessions):
    session = sessions("hf_segments")
    feeds = {"input_ids": np.full((2, 5), 7), "attention_mask": np.ones((2, 5), bool),
             "token_type_ids": np.array([[0, 0, 1, 1, 1], [0, 1, 2, 1, 0]])}
    with pytest.raises(InputError, match="token_type_ids holds id 2: its segment table has 2 rows in this model, so "
                                         "segment ids are 0 to 1"):
        session.run(feeds)
    feeds["token_type_ids"][1, 2] = 1
    assert session.run(feeds)["last_hidden_state"].shape == (2, 5, 32)


@pytest.mark.parametrize(("file", "name", "shape", "words"), [
    ("hf_vision", "pixel_values", (2, 3, 24, 32), r"pixel_values has height 24 \(expected 32\)"),
    ("hf_audio", "input_features", (2, 8, 30), r"input_features has frames 30 \(expected 32\)"),
])
def test_the_vision_and_audio_files_refuse_another_size(sessions, file, name, shape, words):
    with pytest.raises(InputError, match=words):
        sessions(file).run({name: np.zeros(shape, np.float32)})
