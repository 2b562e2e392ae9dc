"""Attacks on token ids: a vocabulary recorded from the wrong table, ids that wrap around or fall past the
table, and ids that are not integers, through every surface that takes them."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from mha_deploy.cli import main
from mha_deploy.errors import ExportError, InputError, ModelFileError
from mha_deploy.exporters.export import set_metadata
from mha_deploy.metadata import ModelMetadata
from mha_deploy.runtime import MHASession
from mha_deploy.runtime.validation import item_problem, validate_inputs
from mha_deploy.signature import OUTPUT, PADDING_MASK, TOKENS, Signature, TensorSpec
from tests.adversarial.conftest import assert_loud, infer

torch = pytest.importorskip("torch")
F = torch.nn.functional

VOCAB, WIDTH = 1000, 8
IDS_AND_MASK = ["ids:tokens", "mask:padding-mask"]


class _BareTokenTable(torch.nn.Module):
    """The token table a bare nn.Parameter, beside a 2-row segment nn.Embedding fed zeros."""

    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Parameter(torch.randn(VOCAB, WIDTH))
        self.segment = torch.nn.Embedding(2, WIDTH)
        self.head = torch.nn.Linear(WIDTH, 2)

    def forward(self, ids, mask):
        x = self.tok[ids] + self.segment(torch.zeros_like(ids))
        return self.head((x * mask.unsqueeze(-1)).sum(1))


class _FunctionalLookup(torch.nn.Module):
    """``F.embedding(ids, self.tok.weight)``: the token table is never called, the 128-row position table is."""

    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, WIDTH)
        self.pos = torch.nn.Embedding(128, WIDTH)
        self.head = torch.nn.Linear(WIDTH, 2)

    def forward(self, ids, mask):
        x = F.embedding(ids, self.tok.weight) + self.pos(torch.arange(ids.size(1)))[None]
        return self.head((x * mask.unsqueeze(-1)).sum(1))


def _token_graph(path, table: str = "fp32", positions: bool = False):
    """An ONNX graph from elsewhere: ids -> Gather from a [1000, 8] table (``fp16``: stored in fp16 and cast
    up), plus, with ``positions``, RoBERTa's position ids (a cumulative sum over ids != pad) into a 300-row
    table; summed over the mask's real tokens -> [batch, 8]."""
    rng = np.random.default_rng(0)
    dtype = np.float16 if table == "fp16" else np.float32
    initializers = [numpy_helper.from_array(rng.standard_normal((VOCAB, WIDTH)).astype(dtype), "tok"),
                    numpy_helper.from_array(np.array([-1], np.int64), "last"),
                    numpy_helper.from_array(np.array([1], np.int64), "seq_axis")]
    nodes = []
    rows = "tok"
    if table == "fp16":
        nodes.append(helper.make_node("Cast", ["tok"], ["tok32"], to=TensorProto.FLOAT))
        rows = "tok32"
    nodes.append(helper.make_node("Gather", [rows, "ids"], ["x"]))
    if positions:
        initializers += [numpy_helper.from_array(rng.standard_normal((300, WIDTH)).astype(np.float32), "pos"),
                         numpy_helper.from_array(np.array(1, np.int64), "pad"),
                         numpy_helper.from_array(np.array(1, np.int64), "one")]
        nodes += [
            helper.make_node("Equal", ["ids", "pad"], ["is_pad"]),
            helper.make_node("Not", ["is_pad"], ["real"]),
            helper.make_node("Cast", ["real"], ["real_int"], to=TensorProto.INT64),
            helper.make_node("CumSum", ["real_int", "one"], ["count"]),
            helper.make_node("Mul", ["count", "real_int"], ["counted"]),
            helper.make_node("Add", ["counted", "pad"], ["position"]),
            helper.make_node("Gather", ["pos", "position"], ["p"]),
            helper.make_node("Add", ["x", "p"], ["xp"]),
        ]
    embedded = "xp" if positions else "x"
    nodes += [
        helper.make_node("Cast", ["mask"], ["mask_float"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mask_float", "last"], ["mask3"]),
        helper.make_node("Mul", [embedded, "mask3"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "seq_axis"], ["output"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "tokens",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("mask", TensorProto.BOOL, ["batch", "seq"])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", WIDTH])], initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def optimized(tmp_path_factory):
    """``optimized(table, positions) -> (path, ExportResult)``: ``_token_graph`` through optimize, once each."""
    from mha_deploy.exporters import optimize_model

    cache = {}

    def optimize(table: str = "fp32", positions: bool = False):
        if (table, positions) not in cache:
            folder = tmp_path_factory.mktemp("tokens")
            source = _token_graph(folder / "source.onnx", table, positions)
            result = optimize_model(source, folder / "model.onnx", IDS_AND_MASK, max_length=64)
            cache[table, positions] = folder / "model.onnx", result
        return cache[table, positions]

    return optimize


# Round 3, defect 2: the vocabulary is the table the ids index, not the smallest table the module holds.
@pytest.mark.parametrize("module", [_BareTokenTable, _FunctionalLookup])
def test_export_records_the_table_the_ids_index(tmp_path, module):
    from mha_deploy.exporters.export import export_model

    torch.manual_seed(0)
    result = export_model(module(), tmp_path / "m.onnx", IDS_AND_MASK, max_length=64)
    assert result.metadata.signature.tensors["ids"].vocab == VOCAB and not result.warnings
    session = MHASession(tmp_path / "m.onnx", provider="cpu")
    session.run({"ids": np.array([[999, 500, 3]]), "mask": np.ones((1, 3), bool)})
    with pytest.raises(InputError, match="holds id 1000: this model's vocabulary is ids 0 to 999"):
        session.run({"ids": np.array([[1000, 1]]), "mask": np.ones((1, 2), bool)})


def test_optimize_records_the_token_table_not_robertas_position_table(optimized):
    path, result = optimized(positions=True)
    assert result.metadata.signature.tensors["ids"].vocab == VOCAB
    MHASession(path, provider="cpu").run({"ids": np.array([[999, 2, 500]]), "mask": np.ones((1, 3), bool)})


def test_parity_draws_ids_across_the_whole_table(monkeypatch, tmp_path):
    """The ids parity feeds reach past every smaller table the module holds."""
    from mha_deploy.exporters import parity
    from mha_deploy.exporters.export import export_model

    drawn = []
    make_inputs = parity.make_inputs

    def watching(*args, **kwargs):
        inputs = make_inputs(*args, **kwargs)
        drawn.append(int(inputs["ids"].max()))
        return inputs

    monkeypatch.setattr(parity, "make_inputs", watching)
    export_model(_FunctionalLookup(), tmp_path / "m.onnx", IDS_AND_MASK, max_length=64)
    assert drawn and max(drawn) >= 128


# Round 3, defect 3: ids below 0 read a Gather's table from its end; ids past it fail inside ORT (HTTP 500).
def test_negative_ids_are_refused_whatever_the_vocabulary_knows():
    ids = TensorSpec("ids", TOKENS, "int64", ("batch", "seq"))  # vocab None: unknown
    mask = TensorSpec("mask", PADDING_MASK, "bool", ("batch", "seq"), marks="ids")
    out = TensorSpec("output", OUTPUT, "float32", ("batch", WIDTH))
    metadata = ModelMetadata(d_model=WIDTH, num_heads=1, signature=Signature.custom((ids, mask), (out,)))
    with pytest.raises(InputError, match="ids holds id -1: token ids are 0 or more"):
        validate_inputs(metadata, {"ids": np.array([[5, -1, 7, 8]]), "mask": np.ones((1, 4), bool)})
    problem = item_problem(metadata, {"ids": np.array([5, -1, 7, 8])})
    assert problem.kind == "id_out_of_range" and "holds id -1" in problem.message


@pytest.mark.parametrize("bad", [-1, VOCAB])
def test_ids_off_the_table_are_refused_by_the_session_and_infer(optimized, tmp_path, bad):
    """After optimize of a graph whose table is stored in fp16 and cast up (once "the vocabulary is unknown"):
    -1 answered as 999 did; 1000 was ORT's error, and aborted ``--on-error skip``."""
    path, result = optimized("fp16")
    assert result.metadata.signature.tensors["ids"].vocab == VOCAB
    session = MHASession(path, provider="cpu")
    with pytest.raises(InputError, match=f"ids holds id {bad}: this model's vocabulary is ids 0 to 999"):
        session.run({"ids": np.array([[5, bad, 7, 8]]), "mask": np.ones((1, 4), bool)})
    np.savez(tmp_path / "items.npz", good=np.array([5, 6, 7]), bad=np.array([5, bad, 7, 8]))
    assert_loud(infer(path, tmp_path / "items.npz", tmp_path / "out.npz"), f"holds id {bad}")
    skipped = infer(path, tmp_path / "items.npz", tmp_path / "skipped.npz", "--on-error", "skip")
    assert skipped.exit_code == 0, skipped.output
    assert set(np.load(tmp_path / "skipped.npz")) == {"good"}


def _with_vocabulary(path, vocab: int | None, written):
    """The model at ``path`` with its metadata's vocabulary for ``ids`` set to ``vocab``, written to ``written``."""
    model = onnx.load(str(path))
    metadata = ModelMetadata.from_props({p.key: p.value for p in model.metadata_props})
    signature = metadata.signature
    inputs = tuple(replace(s, vocab=vocab) if s.name == "ids" else s for s in signature.custom_inputs)
    set_metadata(model, replace(metadata, signature=replace(signature, custom_inputs=inputs)))
    onnx.save(model, str(written))
    return written


def test_a_file_recording_no_vocabulary_is_checked_against_its_graphs_table(optimized, tmp_path):
    path, _ = optimized()
    unknown = MHASession(_with_vocabulary(path, None, tmp_path / "unknown.onnx"), provider="cpu")
    with pytest.raises(InputError, match="holds id 1000: this model's vocabulary is ids 0 to 999"):
        unknown.run({"ids": np.array([[1000]]), "mask": np.ones((1, 1), bool)})
    with pytest.raises(ModelFileError, match="vocabulary of 2000, the table its ids index in the graph has 1000"):
        MHASession(_with_vocabulary(path, 2000, tmp_path / "lying.onnx"), provider="cpu")


def test_ids_off_the_table_are_400_on_rest_and_invalid_argument_on_grpc(optimized, tmp_path):
    tritonclient_grpc = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    from tests.serving.helpers import Server

    path, _ = optimized("fp16")
    server = Server(path, tmp_path / "server.log", grpc=True).wait_ready()
    try:
        for bad in (-1, VOCAB):
            ids = np.array([[5, bad, 7, 8]], np.int64)
            body = json.dumps({"inputs": [
                {"name": "ids", "shape": [1, 4], "datatype": "INT64", "data": ids.ravel().tolist()},
                {"name": "mask", "shape": [1, 4], "datatype": "BOOL", "data": [True] * 4},
            ]}).encode()
            status, _, answer = server.request("POST", f"/v2/models/{path.stem}/infer", body,
                                               {"Content-Type": "application/json"})
            assert status == 400 and f"holds id {bad}" in answer.decode(), (status, answer)
            client = tritonclient_grpc.InferenceServerClient(server.grpc_url)
            tensors = [tritonclient_grpc.InferInput("ids", [1, 4], "INT64"),
                       tritonclient_grpc.InferInput("mask", [1, 4], "BOOL")]
            tensors[0].set_data_from_numpy(ids)
            tensors[1].set_data_from_numpy(np.ones((1, 4), bool))
            with pytest.raises(InferenceServerException, match=f"holds id {bad}") as refused:
                client.infer(path.stem, tensors)
            assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    finally:
        server.stop()


# Round 3, weak: a NaN row passed parity (never drawn), then every run of that id blamed float32 overflow.
def test_an_embedding_row_of_nan_is_refused_at_export_naming_the_table_and_row(tmp_path):
    from mha_deploy.exporters.export import export_model

    module = _BareTokenTable()
    with torch.no_grad():
        module.tok[17] = float("nan")
    refusal = r"input ids: the \[1000, 8\] embedding table .* holds NaN or Inf in row\(s\) 17"
    with pytest.raises(ExportError, match=refusal):
        export_model(module, tmp_path / "m.onnx", IDS_AND_MASK)
    assert list(tmp_path.iterdir()) == []


# Round 3, weak: uint64 ids past int64 wrapped to "holds id -1".
def test_uint64_ids_past_int64_are_named_as_they_are(optimized):
    session = MHASession(optimized()[0], provider="cpu")
    huge = np.array([[5, 2**64 - 1]], np.uint64)
    with pytest.raises(InputError, match=f"ids holds id {2**64 - 1}: this model's vocabulary is ids 0 to 999"):
        session.run({"ids": huge, "mask": np.ones((1, 2), bool)})
    problem = item_problem(session.metadata, {"ids": huge[0]})
    assert problem.kind == "id_out_of_range" and f"holds id {2**64 - 1}" in problem.message
    session.run({"ids": np.array([[5, 999]], np.uint64), "mask": np.ones((1, 2), bool)})


# Round 3, weak: JSON true among INT64 ids was taken as id 1.
def test_json_true_among_ids_is_refused_on_v1_and_v2(optimized):
    from mha_deploy.serving.http import parsing, v2

    with pytest.raises(parsing.RequestError, match="input ids: data holds true/false, expected integers") as v2_refused:
        v2.array_from_list("ids", np.dtype(np.int64), [1, 3], [5, True, 7])
    assert v2_refused.value.status == 400
    metadata = MHASession(optimized()[0], provider="cpu").metadata
    body = json.dumps({"ids": [5, True, 7]}).encode()
    with pytest.raises(parsing.RequestError, match="ids holds booleans") as v1_refused:
        parsing.parse_request(body, parsing.JSON, metadata, parsing.RequestLimits())
    assert v1_refused.value.status == 422


# Round 3, weak: a null element and a uint64 id past int64 in a Parquet ids column both read as "holds id -1".
def test_parquet_null_and_uint64_ids_are_named_as_they_are(optimized, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path, _ = optimized()
    for name, ids, fragment in [
        ("null", pa.array([[5, 6], [5, None, 7]], pa.list_(pa.int64())), "ids holds a null id at position 1"),
        ("huge", pa.array([[5, 6], [5, 2**64 - 1]], pa.list_(pa.uint64())), f"ids holds id {2**64 - 1}"),
    ]:
        source = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"id": ["good", "bad"], "ids": ids}), source)
        assert_loud(infer(path, source, tmp_path / f"{name}-out.parquet"), "item 'bad'", fragment)


# Round 3, weak: `inspect` (text) never showed the vocabulary.
def test_inspect_shows_each_token_inputs_vocabulary(optimized, tmp_path):
    path, _ = optimized()
    shown = CliRunner().invoke(main, ["inspect", str(path)])
    assert shown.exit_code == 0 and "tokens ids: vocabulary 1000 (ids 0 to 999)" in shown.output, shown.output
    unrecorded = _with_vocabulary(path, None, tmp_path / "unrecorded.onnx")
    shown = CliRunner().invoke(main, ["inspect", str(unrecorded)])
    assert "tokens ids: vocabulary not recorded; the table its ids index has 1000 rows" in shown.output, shown.output
