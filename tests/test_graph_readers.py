"""The readers that need a file's graph only (input names, shapes, the metadata, which layout its cache keeps) never
parse its weights: ``onnx.load`` holds the file's bytes and the parsed weights at once (about twice the weights,
runtime.session_file's docstring), so each reads through ``session_file.read_graph`` instead. Pinned by making
``onnx.load`` fail while they read; the Triton writer reads the weights only to write the copy it bounds, which
must then hold them inline, standing alone in its repository."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from mha_deploy.batch.generation import prompt_limits
from mha_deploy.metadata import CACHE_RAGGED
from mha_deploy.model_report import describe_model, read_metadata
from mha_deploy.runtime.cache_layout import read_cache_layout
from mha_deploy.runtime.kv_stepper import KVCacheStepper
from mha_deploy.serving.http.server import is_generator
from mha_deploy.serving.triton import TritonConfig, TritonExportError, write_triton_model


def _refuse_whole_file_loads(monkeypatch) -> None:
    def whole_file(*args, **kwargs):
        raise AssertionError("onnx.load parsed the whole file, weights and all")

    monkeypatch.setattr(onnx, "load", whole_file)
    monkeypatch.setattr(onnx, "load_model", whole_file)


def test_a_decoders_graph_readers_never_parse_its_weights(lm_cache, seq2seq, monkeypatch):
    """A ragged decoder's file: its cache layout read off the graph (no metadata given), served as a generator, its
    metadata and inspect report; an encoder-decoder's source vocabulary read off its encoder's token table."""
    path, _ = lm_cache("causal_lm")
    decoder, encoder, start, vocab = seq2seq
    stepper = KVCacheStepper(decoder, encoder=encoder, decoder_start_token_id=start)
    _refuse_whole_file_loads(monkeypatch)
    assert read_cache_layout(None, path) == CACHE_RAGGED
    assert is_generator(path)
    assert read_metadata(path).cache_layout == CACHE_RAGGED
    assert describe_model(path).op_counts["com.microsoft::GroupQueryAttention"] == read_metadata(path).layers
    assert prompt_limits(stepper).vocab == vocab


def test_triton_reads_the_weights_only_for_its_bounded_copy_which_holds_them_inline(own_model, tmp_path,
                                                                                   monkeypatch):
    """The classifier's entry (its token ids and lengths bounded in the copy): written with ``onnx.load`` failing,
    every weight of the copy inline and equal to the file's, none pointing back at the source."""
    path = own_model("classifier")[0]
    source = onnx.load(str(path))
    _refuse_whole_file_loads(monkeypatch)
    target = write_triton_model(path, tmp_path / "repo", TritonConfig(name="classifier"))
    monkeypatch.undo()
    copy = onnx.load(str(target / "1" / "model.onnx"), load_external_data=False)
    assert not [t.name for t in copy.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    weights = {t.name: numpy_helper.to_array(t) for t in copy.graph.initializer}
    assert len(copy.graph.node) > len(source.graph.node)  # the bounds' checks were added
    for tensor in source.graph.initializer:
        np.testing.assert_array_equal(weights[tensor.name], numpy_helper.to_array(tensor), err_msg=tensor.name)


def test_triton_refuses_weights_kept_in_another_file(own_model, tmp_path):
    """Only single-file models are copied: a file whose weights sit in an external-data file is refused by name
    (the weights read_graph leaves in the file itself are not such a file)."""
    model = onnx.load(str(own_model("classifier")[0]))
    split = tmp_path / "split.onnx"
    onnx.save_model(model, split, save_as_external_data=True, location="split.onnx.data", size_threshold=0)
    with pytest.raises(TritonExportError, match="keeps weights in external data files"):
        write_triton_model(split, tmp_path / "repo")
