"""`mha-deploy serve` over a user's own classifier, driven by tritonclient (HTTP and gRPC, INT64 token ids):
a padded batch answered row by row as the module answers each item alone."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
tritonclient_http = pytest.importorskip("tritonclient.http")
tritonclient_grpc = pytest.importorskip("tritonclient.grpc")

from click.testing import CliRunner  # noqa: E402

from mha_deploy.cli import main  # noqa: E402
from tests.conftest import user_module  # noqa: E402
from tests.serving.test_triton import check_against_model, parse_config  # noqa: E402

ATOL, RTOL = 2e-5, 1e-4


@pytest.fixture(scope="module")
def classifier_servers(own_model, start_server):
    """``serve(factory) -> (model name, server)``: the classifier built by ``factory``, served once per module."""
    servers = {}

    def serve(factory: str):
        if factory not in servers:
            path = own_model("classifier", factory)[0]
            servers[factory] = path.stem, start_server(path, grpc=True)
        return servers[factory]

    return serve


@pytest.fixture(scope="module")
def classifier_server(classifier_servers):
    return classifier_servers("build")


def _batch(seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = [5, 17, 1, 12]
    ids = np.zeros((len(lengths), max(lengths)), np.int64)
    mask = np.zeros(ids.shape, bool)
    for row, length in enumerate(lengths):
        ids[row, :length] = rng.integers(0, 50, length)
        mask[row, :length] = True
    return ids, mask


def _alone(ids: np.ndarray, mask: np.ndarray, factory: str = "build") -> np.ndarray:
    module = getattr(user_module("classifier"), factory)().eval()
    with torch.no_grad():
        return np.stack([
            module(torch.from_numpy(row[keep])[None], torch.ones(1, int(keep.sum()), dtype=torch.bool))[0].numpy()
            for row, keep in zip(ids, mask, strict=True)
        ])


# build_wide: an export with its tokens packed (token_packing), as wider models are by default
@pytest.mark.parametrize(("protocol", "factory"), [("http", "build"), ("grpc", "build"), ("http", "build_wide")])
def test_tritonclient_gets_the_module_answer_per_row(classifier_servers, protocol, factory):
    name, server = classifier_servers(factory)
    client_module = tritonclient_http if protocol == "http" else tritonclient_grpc
    client = client_module.InferenceServerClient(server.url if protocol == "http" else server.grpc_url)
    ids, mask = _batch()
    tensors = [client_module.InferInput("input_ids", list(ids.shape), "INT64"),
               client_module.InferInput("attention_mask", list(mask.shape), "BOOL")]
    tensors[0].set_data_from_numpy(ids)
    tensors[1].set_data_from_numpy(mask)
    logits = client.infer(name, tensors).as_numpy("output")
    assert logits.shape == (4, 3)
    np.testing.assert_allclose(logits, _alone(ids, mask, factory), atol=ATOL, rtol=RTOL)


def test_the_model_metadata_describes_ids_and_logits(classifier_server):
    name, server = classifier_server
    metadata = tritonclient_http.InferenceServerClient(server.url).get_model_metadata(name)
    assert metadata["inputs"] == [{"name": "input_ids", "datatype": "INT64", "shape": [-1, -1]},
                                  {"name": "attention_mask", "datatype": "BOOL", "shape": [-1, -1]}]
    assert metadata["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 3]}]


def test_float_ids_are_refused(classifier_server):
    name, server = classifier_server
    client = tritonclient_http.InferenceServerClient(server.url)
    tensor = tritonclient_http.InferInput("input_ids", [1, 2], "FP32")
    tensor.set_data_from_numpy(np.array([[1.0, 2.0]], np.float32))
    with pytest.raises(Exception, match="datatype 'FP32', this model takes INT64"):
        client.infer(name, [tensor])


def test_triton_repository_for_the_classifier(own_model, tmp_path):
    path = own_model("classifier")[0]
    result = CliRunner().invoke(main, ["triton", str(path), "--repo", str(tmp_path), "--name", "classifier"])
    assert result.exit_code == 0, result.output
    config = parse_config(tmp_path / "classifier" / "config.pbtxt")
    check_against_model(config, onnx.load(str(path)))
    assert [(t.name, list(t.dims)) for t in config.input] == [("input_ids", [-1]), ("attention_mask", [-1])]
    assert [(t.name, list(t.dims)) for t in config.output] == [("output", [3])]


def test_grpc_typed_int64_contents(classifier_server):
    """Token ids as contents.int64_contents (varints on the wire), not raw bytes."""
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc

    name, server = classifier_server
    ids, mask = _batch()
    request = pb.ModelInferRequest(model_name=name)
    for tensor_name, array, datatype, field in (("input_ids", ids, "INT64", "int64_contents"),
                                                ("attention_mask", mask, "BOOL", "bool_contents")):
        tensor = request.inputs.add(name=tensor_name, datatype=datatype, shape=list(array.shape))
        getattr(tensor.contents, field).extend(array.ravel().tolist())
    with grpc.insecure_channel(server.grpc_url) as channel:
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=20)
    logits = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(4, 3)
    np.testing.assert_allclose(logits, _alone(ids, mask), atol=ATOL, rtol=RTOL)


# Users' models as they come: a Hugging Face encoder (per-token hidden states) and an encoder-decoder (logits over
# the target, the encoder's hidden states over the source), outputs named as the forwards return them.
SERVED_FAMILIES = [("hf_encoder", "build_distilbert"), ("hf_seq2seq", "build_bart_eager")]
FAMILY_OUTPUTS = {"hf_encoder": {"last_hidden_state": "input_ids"},
                  "hf_seq2seq": {"logits": "decoder_input_ids", "encoder_last_hidden_state": "input_ids"}}


@pytest.fixture(scope="module")
def family_servers(own_model, start_server):
    servers = {}

    def serve(file: str, factory: str):
        if (file, factory) not in servers:
            path = own_model(file, factory)[0]
            servers[file, factory] = path.stem, start_server(path, grpc=True)
        return servers[file, factory]

    return serve


def _family_items(file: str, seed: int = 6) -> list[dict[str, np.ndarray]]:
    """Items of different lengths, unpadded: each input by name (ids only; the server builds the masks)."""
    rng = np.random.default_rng(seed)
    names = ("input_ids", "decoder_input_ids") if file == "hf_seq2seq" else ("input_ids",)
    return [{name: rng.integers(2, 96, int(rng.integers(2, 14))) for name in names} for _ in range(4)]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize(("file", "factory"), SERVED_FAMILIES)
def test_tritonclient_gets_a_users_model_answer_item_by_item(family_servers, file, factory, protocol):
    name, server = family_servers(file, factory)
    client_module = tritonclient_http if protocol == "http" else tritonclient_grpc
    client = client_module.InferenceServerClient(server.url if protocol == "http" else server.grpc_url)
    items = _family_items(file)
    masks = {"input_ids": "attention_mask", "decoder_input_ids": "decoder_attention_mask"}
    tensors = []
    for ids_name, mask_name in masks.items():
        if ids_name not in items[0]:
            continue
        ids = np.ones((len(items), max(len(item[ids_name]) for item in items)), np.int64)  # padded with pad ids
        mask = np.zeros(ids.shape, bool)
        for row, item in enumerate(items):
            ids[row, : len(item[ids_name])] = item[ids_name]
            mask[row, : len(item[ids_name])] = True
        for tensor_name, array, datatype in ((ids_name, ids, "INT64"), (mask_name, mask, "BOOL")):
            tensor = client_module.InferInput(tensor_name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
    response = client.infer(name, tensors)
    module = getattr(user_module(file), factory)().eval()
    # each output, as the forward names it -> the input whose positions are its rows
    rows_of = FAMILY_OUTPUTS[file]
    metadata = client.get_model_metadata(name, **({"as_json": True} if protocol == "grpc" else {}))
    assert [output["name"] for output in metadata["outputs"]] == list(rows_of)
    for row, item in enumerate(items):
        feeds = {key: torch.from_numpy(value)[None] for key, value in item.items()}
        feeds.update({masks[key]: torch.ones_like(value) for key, value in feeds.items()})
        with torch.no_grad():
            alone = module(**feeds)
        for output, rows in rows_of.items():
            real = len(item[rows])
            np.testing.assert_allclose(response.as_numpy(output)[row, :real], alone[output][0].numpy(),
                                       atol=ATOL, rtol=RTOL, err_msg=f"{file}:{factory} {output} item {row}")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_sequence_longer_than_the_position_table_is_a_bad_request(classifier_server, protocol):
    """The export recorded the classifier's position table (512): 513 tokens are refused before ONNX Runtime,
    400 over REST, INVALID_ARGUMENT over gRPC, naming the limit; the server keeps answering."""
    name, server = classifier_server
    client_module = tritonclient_http if protocol == "http" else tritonclient_grpc
    client = client_module.InferenceServerClient(server.url if protocol == "http" else server.grpc_url)

    def infer(length: int):
        tensors = [client_module.InferInput("input_ids", [1, length], "INT64"),
                   client_module.InferInput("attention_mask", [1, length], "BOOL")]
        tensors[0].set_data_from_numpy(np.ones((1, length), np.int64))
        tensors[1].set_data_from_numpy(np.ones((1, length), bool))
        return client.infer(name, tensors)

    with pytest.raises(Exception, match="this model takes at most 512") as raised:
        infer(513)
    assert raised.value.status() == ("400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT")
    assert infer(512).as_numpy("output").shape == (1, 3)
