"""Issue 38: a Triton repository ran the file without the validator, so a negative token id was read by
ONNX's Gather as a row from the table's end (a plausible answer, and wrong) and a sequence past the max length
reached the position table. The repository's copy now checks both itself, on the ORT session Triton runs."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from mha_deploy.runtime import MHASession
from mha_deploy.serving.triton import TritonConfig, write_triton_model


@pytest.fixture(scope="module")
def classifier_entry(own_model, tmp_path_factory):
    """The classifier's file and the session Triton's onnxruntime backend makes of its repository copy."""
    path = own_model("classifier")[0]
    target = write_triton_model(path, tmp_path_factory.mktemp("repo"), TritonConfig(name="classifier"))
    return path, ort.InferenceSession(str(target / "1" / "model.onnx"), providers=["CPUExecutionProvider"])


def _feeds(ids):
    ids = np.asarray(ids, np.int64)
    return {"input_ids": ids, "attention_mask": np.ones(ids.shape, bool)}


def test_the_repository_copy_answers_what_the_file_answers(classifier_entry):
    path, triton = classifier_entry
    session = MHASession(path, provider="cpu")
    ids = np.random.default_rng(0).integers(0, session.signature.tensors["input_ids"].vocab, (3, 17))
    np.testing.assert_array_equal(triton.run(None, _feeds(ids))[0], session.run(_feeds(ids))["output"])


@pytest.mark.parametrize("bad", [-1, "vocab"], ids=["negative", "past-the-vocabulary"])
def test_an_id_outside_the_vocabulary_fails_the_request_naming_the_bound(classifier_entry, bad):
    path, triton = classifier_entry
    vocab = MHASession(path, provider="cpu").signature.tensors["input_ids"].vocab
    ids = np.ones((2, 5), np.int64)
    ids[1, 3] = vocab if bad == "vocab" else bad
    with pytest.raises(Exception, match=rf"input_ids: token ids must be in \[0, {vocab}\)"):
        triton.run(None, _feeds(ids))


def test_a_sequence_past_the_max_length_fails_the_request_naming_it(classifier_entry):
    path, triton = classifier_entry
    max_length = MHASession(path, provider="cpu").metadata.max_length
    assert max_length is not None
    triton.run(None, _feeds(np.ones((1, max_length), np.int64)))  # the longest it takes still runs
    with pytest.raises(Exception, match=rf"(input_ids|attention_mask): at most {max_length} positions"):
        triton.run(None, _feeds(np.ones((1, max_length + 1), np.int64)))
