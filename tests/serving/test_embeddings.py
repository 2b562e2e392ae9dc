"""OpenAI's ``POST /v1/embeddings`` on the plain server, driven by the official ``openai`` client: a sentence-embedding
model (Hugging Face BERT from a small config, mean-pooled over the attention mask: tests/user_models/hf_sentence.py)
exported once by ``mha-deploy export --module``, served by ``mha-deploy serve --tokenizer``; and the same weights as
the folder sentence-transformers saves, exported by ``mha-deploy export --hf DIR`` (its pooled output,
``sentence_embedding``) and served with the tokenizer the export wrote beside it. Texts and token ids in,
float and base64 out, each vector the module's pooled output for that input alone, scaled to unit length; a batch of
inputs of different lengths answers each as alone; bad requests are 400s naming the field; ``infer`` writes what the
server returns before normalisation. Servers that need settings the CLI lacks run in this process (uvicorn thread)."""

from __future__ import annotations

import base64
import contextlib
import json
import time

import numpy as np
import pytest

from tests.conftest import user_module
from tests.serving.helpers import app_on_loopback, http_request

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
pytest.importorskip("tokenizers")
uvicorn = pytest.importorskip("uvicorn")

from click.testing import CliRunner  # noqa: E402

from mha_deploy.batch.generation import PromptTokenizer  # noqa: E402
from mha_deploy.cli import main  # noqa: E402
from mha_deploy.metadata import Signature  # noqa: E402
from mha_deploy.runtime import MHASession  # noqa: E402
from mha_deploy.serving.http import EmbeddingOptions  # noqa: E402
from mha_deploy.serving.http.app import create_app  # noqa: E402

NAME = "sentence"
VOCAB, DIMENSIONS = 96, 32  # hf_models' sizes
MAX_ITEM_TOKENS = 64
TEXT = """the cat sat on the mat and the dog sat on the log . a bird sang in the tree while the sun rose over
the hill . the dog ran to the cat and the cat ran up the tree . the bird flew over the hill and the sun set ."""
SENTENCES = ["the cat sat on the mat", "a bird", "the dog ran to the cat and the cat ran up the tree while the sun set",
             "the sun rose over the hill ."]
# fp32: ORT's fused kernels over a padded batch against the module alone in torch; unit vectors, so absolute.
ATOL = 2e-5


def train_tokenizer(path):
    """A word-level tokenizer with BERT's special tokens ([PAD] is id 1, the config's pad id), adding [CLS] and [SEP]
    around each text as BERT's does."""
    from tokenizers import Tokenizer, processors
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from tokenizers.trainers import WordLevelTrainer

    tokenizer = Tokenizer(WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.train_from_iterator([TEXT], WordLevelTrainer(vocab_size=VOCAB,
                                                           special_tokens=["[UNK]", "[PAD]", "[CLS]", "[SEP]"]))
    tokenizer.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                             special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tokenizer.save(str(path))
    return tokenizer


@pytest.fixture(scope="module")
def sentence_model(own_model, tmp_path_factory):
    """(model path, tokenizer path, tokenizer): the export, once."""
    path = own_model("hf_sentence")[0]
    tokenizer_path = tmp_path_factory.mktemp("sentence") / "tokenizer.json"
    return path, tokenizer_path, train_tokenizer(tokenizer_path)


@pytest.fixture(scope="module")
def folder_model(sentence_model, tmp_path_factory):
    """(model path, tokenizer path): hf_sentence's weights saved as a sentence-transformers folder (mean pooling, no
    Normalize: the vectors of the --module export) with the tokenizer, exported by ``export --hf DIR`` alone."""
    folder = user_module("hf_sentence").save_folder(tmp_path_factory.mktemp("st") / "folder", sentence_model[2])
    path = tmp_path_factory.mktemp("st-onnx") / "model.onnx"
    result = CliRunner().invoke(main, ["export", "--hf", str(folder), "-o", str(path)])
    assert result.exit_code == 0, result.output
    return path, path.parent / "tokenizer.json"


@pytest.fixture(scope="module")
def server(sentence_model, start_server):
    path, tokenizer_path, _ = sentence_model
    return start_server(path, "--name", NAME, "--tokenizer", str(tokenizer_path), "--threads", "2",
                        "--max-wait-ms", "5", "--max-item-tokens", str(MAX_ITEM_TOKENS))


@pytest.fixture(scope="module")
def folder_server(folder_model, start_server):
    """The --hf export served with no --tokenizer: serve takes the tokenizer.json export wrote beside the file."""
    return start_server(folder_model[0], "--name", NAME, "--threads", "2", "--max-wait-ms", "5", "--max-item-tokens",
                        str(MAX_ITEM_TOKENS))


# Which export a test serves: "module" (export --module) or "folder" (export --hf of the sentence-transformers folder).
SOURCES = {"module": "server", "folder": "folder_server"}


@pytest.fixture(scope="module")
def module():
    return user_module("hf_sentence").build()


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)


def pooled(module, ids) -> np.ndarray:
    """The module's output for ``ids`` alone: [d]."""
    with torch.no_grad():
        ids = torch.tensor([list(ids)])
        return module(ids, torch.ones_like(ids, dtype=torch.bool))[0].numpy()


def unit(vector: np.ndarray) -> np.ndarray:
    return vector / np.linalg.norm(vector)


# None: the client's default, which asks for base64 and decodes it itself; "base64" asked for: the string is the
# caller's to decode (little-endian float32, as OpenAI documents it).
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("encoding", ["float", "base64", None])
def test_a_text_is_the_modules_pooled_output_normalised(request, sentence_model, module, encoding, source):
    server, tokenizer = request.getfixturevalue(SOURCES[source]), sentence_model[2]
    fields = {"encoding_format": encoding} if encoding is not None else {}
    answer = client(server.port).embeddings.create(model=NAME, input=SENTENCES[0], **fields)
    ids = tokenizer.encode(SENTENCES[0]).ids
    assert ids[0] == 2 and ids[-1] == 3  # the tokenizer's [CLS] ... [SEP], as BERT's
    assert answer.model == NAME and len(answer.data) == 1 and answer.data[0].index == 0
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == len(ids)
    vector = answer.data[0].embedding
    if encoding == "base64":
        assert isinstance(vector, str)
        vector = np.frombuffer(base64.b64decode(vector), "<f4")
    vector = np.asarray(vector, np.float32)
    assert vector.shape == (DIMENSIONS,)
    np.testing.assert_allclose(np.linalg.norm(vector), 1.0, atol=1e-6)
    np.testing.assert_allclose(vector, unit(pooled(module, ids)), atol=ATOL)


def test_inputs_of_different_lengths_in_one_request_equal_each_alone(server, sentence_model, module):
    """Padding must not leak: the longest input pads the others in the batch, and each still equals itself alone."""
    openai_client, tokenizer = client(server.port), sentence_model[2]
    together = openai_client.embeddings.create(model=NAME, input=SENTENCES, encoding_format="float")
    assert [d.index for d in together.data] == list(range(len(SENTENCES)))
    lengths = [len(tokenizer.encode(text).ids) for text in SENTENCES]
    assert len(set(lengths)) == len(lengths)
    assert together.usage.prompt_tokens == sum(lengths)
    for text, datum in zip(SENTENCES, together.data, strict=True):
        alone = openai_client.embeddings.create(model=NAME, input=text, encoding_format="float").data[0].embedding
        np.testing.assert_allclose(datum.embedding, alone, atol=1e-6, err_msg=text)
        np.testing.assert_allclose(datum.embedding, unit(pooled(module, tokenizer.encode(text).ids)), atol=ATOL,
                                   err_msg=text)


def test_token_ids_in_one_list_or_several(server, module):
    openai_client = client(server.port)
    rows = [[2, 5, 9, 17, 3], [2, 40, 3], [2, *range(4, 60), 3]]
    one = openai_client.embeddings.create(model=NAME, input=rows[0], encoding_format="float")
    several = openai_client.embeddings.create(model=NAME, input=rows)  # the client asks for base64 by default
    assert one.usage.prompt_tokens == len(rows[0]) and several.usage.prompt_tokens == sum(map(len, rows))
    np.testing.assert_allclose(one.data[0].embedding, several.data[0].embedding, atol=1e-6)
    for ids, datum in zip(rows, several.data, strict=True):
        np.testing.assert_allclose(datum.embedding, unit(pooled(module, ids)), atol=ATOL)


@pytest.mark.parametrize(("request_fields", "param", "words"), [
    ({"input": ""}, "input", "empty string"),
    ({"input": []}, "input", "is required"),
    ({"input": [[]]}, "input", "empty"),
    ({"input": ["a bird", ""]}, "input", "input[1]"),
    ({"input": [5, VOCAB]}, "input", "vocabulary"),
    ({"input": [5, -1]}, "input", "-1"),
    ({"input": [[5, 6], [2**70]]}, "input", "input[1]"),
    ({"input": [1] * (MAX_ITEM_TOKENS + 1)}, "input", "maximum length"),
    ({"input": [["a", "bird"]]}, "input", "must be a string"),
    ({"input": [1.5, 2]}, "input", "must be a string"),
    ({"input": "a bird", "dimensions": 16}, "dimensions", f"{DIMENSIONS} dimensions"),
    ({"input": "a bird", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
])
def test_bad_requests_are_400s_naming_the_field(server, request_fields, param, words):
    with pytest.raises(openai.BadRequestError) as refused:
        client(server.port).embeddings.create(model=NAME, **request_fields)
    assert refused.value.param == param, refused.value.body
    assert words in refused.value.message, refused.value.message


def test_equal_dimensions_and_user_are_accepted_another_model_is_not(server):
    openai_client = client(server.port)
    answer = openai_client.embeddings.create(model=NAME, input="a bird", dimensions=DIMENSIONS, user="someone")
    assert len(answer.data[0].embedding) == DIMENSIONS
    with pytest.raises(openai.NotFoundError) as refused:
        openai_client.embeddings.create(model="other", input="a bird")
    assert refused.value.param == "model"


def test_texts_without_a_tokenizer_are_refused_ids_are_served(sentence_model):
    with served(sentence_model[0]) as port:
        with pytest.raises(openai.BadRequestError) as refused:
            client(port).embeddings.create(model=NAME, input="a bird")
        assert refused.value.param == "input" and "--tokenizer" in refused.value.message
        assert len(client(port).embeddings.create(model=NAME, input=[2, 5, 3]).data[0].embedding) == DIMENSIONS


@pytest.mark.parametrize("source", SOURCES)
def test_raw_vectors_equal_what_infer_writes(request, sentence_model, module, tmp_path, source):
    """With normalisation off the server returns the model's output as it is, and ``mha-deploy infer`` over the same
    ids writes the same vectors (outputs are written by name: the pooled output, [d] per item)."""
    path, tokenizer_path, tokenizer = sentence_model
    if source == "folder":
        path, tokenizer_path = request.getfixturevalue("folder_model")
    items = {f"doc{i}": np.asarray(tokenizer.encode(text).ids, np.int64) for i, text in enumerate(SENTENCES)}
    np.savez(tmp_path / "items.npz", **items)
    result = CliRunner().invoke(main, ["infer", str(path), "--input", str(tmp_path / "items.npz"), "--output",
                                       str(tmp_path / "out.npz"), "--no-progress", "--provider", "cpu"])
    assert result.exit_code == 0, result.output
    written = dict(np.load(tmp_path / "out.npz"))
    with served(path, EmbeddingOptions(normalize=False), tokenizer_path) as port:
        answer = client(port).embeddings.create(model=NAME, input=SENTENCES)
    suffix = ".sentence_embedding" if source == "folder" else ""  # infer writes "output" under the item's id alone
    for (key, ids), datum in zip(items.items(), answer.data, strict=True):
        raw = np.asarray(datum.embedding, np.float32)
        assert abs(np.linalg.norm(raw) - 1) > 1e-3  # not normalised
        np.testing.assert_allclose(raw, written[key + suffix], atol=2e-6, err_msg=key)
        np.testing.assert_allclose(raw, pooled(module, ids), atol=ATOL, err_msg=key)


def test_an_encoder_without_a_pooled_output_says_why(export_model):
    """Self-attention's output is per token ([batch, seq, d_model]) and it takes float sequences: no embeddings; the
    route answers 400 naming the model, saying what the model takes and returns."""
    path, _ = export_model(Signature("self", "padding"))
    with served(path) as port, pytest.raises(openai.BadRequestError) as refused:
        client(port).embeddings.create(model=NAME, input=[1, 2, 3])
    assert refused.value.param == "model" and "cannot serve embeddings" in refused.value.message
    assert "token ids" in refused.value.message


def test_a_named_output_that_is_no_vector_stops_the_start(sentence_model):
    failures = []
    with served(sentence_model[0], EmbeddingOptions(output="logits"), on_load_error=failures.append, ready=False):
        deadline = time.monotonic() + 60
        while not failures and time.monotonic() < deadline:
            time.sleep(0.05)
    assert failures and "--embedding-output logits" in str(failures[0]), failures
    assert "output [batch, 32]" in str(failures[0])


def test_keys_queue_and_body_limits_hold_as_for_infer(sentence_model):
    """The route is behind the same API keys, and bounded by the same queue and body size as /v2 infer."""
    from mha_deploy.batching import BatchingConfig
    from mha_deploy.serving.http.auth import ApiKeys
    from mha_deploy.serving.http.parsing import RequestLimits

    key = "embeddings-test-key-0123456789"
    with served(sentence_model[0], api_keys=ApiKeys([key]), batching=BatchingConfig(max_queue=3),
                limits=RequestLimits(max_body_bytes=4096)) as port:
        with pytest.raises(openai.AuthenticationError):
            client(port).embeddings.create(model=NAME, input=[2, 5, 3])
        keyed = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60)
        assert len(keyed.embeddings.create(model=NAME, input=[[2, 5, 3]] * 3).data) == 3
        with pytest.raises(openai.BadRequestError) as refused:
            keyed.embeddings.create(model=NAME, input=[[2, 5, 3]] * 4)
        assert refused.value.param == "input" and "at most 3" in refused.value.message
        with pytest.raises(openai.APIStatusError) as refused:
            keyed.embeddings.create(model=NAME, input=[[5] * 1000] * 3)
        assert refused.value.status_code == 413


def test_a_generator_answers_that_it_serves_no_embeddings():
    """The generator's app (no model needed: the refusal does not depend on it) answers 400 naming the model."""
    from mha_deploy.serving.http.generation import GenerationService, GenerationSettings
    from mha_deploy.serving.http.generation_app import create_generation_app
    from mha_deploy.serving.http.parsing import RequestLimits

    def no_engine(metrics):
        raise RuntimeError("no engine in this test")

    service = GenerationService(no_engine, GenerationSettings(), RequestLimits(), "lm")
    app = create_generation_app(service)
    with app_on_loopback(app, ready=False, timeout_s=60) as port, pytest.raises(openai.BadRequestError) as refused:
        client(port).embeddings.create(model="lm", input=[1, 2, 3])
    assert refused.value.param == "model" and "generator" in refused.value.message


def _signature(outputs: dict[str, tuple], first_role: str = "tokens") -> Signature:
    from mha_deploy.signature import TensorSpec

    inputs = (TensorSpec("input_ids", first_role, "int64" if first_role == "tokens" else "model",
                         ("batch", "seq") if first_role == "tokens" else ("batch", "seq", 8)),
              TensorSpec("attention_mask", "padding_mask", "bool", ("batch", "seq"), marks="input_ids"))
    return Signature.custom(inputs, tuple(TensorSpec(name, "output", "model", axes) for name, axes in outputs.items()))


@pytest.mark.parametrize(("outputs", "named", "served_output", "words"), [
    ({"output": ("batch", 32)}, None, "output", ""),
    # BERT as from_pretrained returns it: pooler_output is its next-sentence head's input, no trained embedding
    ({"last_hidden_state": ("batch", "seq", 32), "pooler_output": ("batch", 32)}, None, None,
     "pooler_output is no trained embedding"),
    ({"last_hidden_state": ("batch", "seq", 32), "pooler_output": ("batch", 32)}, "pooler_output", "pooler_output", ""),
    ({"text_embeds": ("batch", 16), "logits": ("batch", 3)}, None, None, "name the one"),
    ({"text_embeds": ("batch", 16), "logits": ("batch", 3)}, "text_embeds", "text_embeds", ""),
    ({"text_embeds": ("batch", 16)}, "last_hidden_state", None, "'last_hidden_state' is not one vector per item"),
    # sentence-transformers' name (export --hf of its folder) is the embedding beside any other vector
    ({"pooled": ("batch", 8), "sentence_embedding": ("batch", 32)}, None, "sentence_embedding", ""),
    ({"last_hidden_state": ("batch", "seq", 32)}, None, None, "no output is an embedding"),
])
def test_which_output_is_served(outputs, named, served_output, words):
    from mha_deploy.serving.http.embeddings import embedding_model

    found = embedding_model(_signature(outputs), named)
    if served_output is None:
        assert isinstance(found, str) and words in found, found
    else:
        assert found.output == served_output and found.tokens == "input_ids"
        assert found.dimensions == outputs[served_output][1]


def test_float_sequences_in_are_no_embedding_model():
    from mha_deploy.serving.http.embeddings import embedding_model

    found = embedding_model(_signature({"output": ("batch", 8)}, first_role="sequence"))
    assert isinstance(found, str) and "input_ids (sequence)" in found and "one input of token ids" in found


# --- servers in this process ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def served(path, options: EmbeddingOptions | None = None, tokenizer=None, on_load_error=None, ready: bool = True,
           batching=None, limits=None, api_keys=None):
    """The plain server's app over ``path`` with ``options``, on a free loopback port (ready unless told)."""
    def load() -> MHASession:
        return MHASession(path, provider="cpu", threads=2)

    app = create_app(load, batching, limits, on_load_error, model_name=NAME, embeddings=options, api_keys=api_keys,
                     tokenizer=PromptTokenizer(tokenizer) if tokenizer is not None else None)
    with app_on_loopback(app, ready, timeout_s=60) as port:
        yield port


def test_errors_have_openais_shape_for_any_http_client(server):
    status, _, body = http_request(server.connection(), "POST", "/v1/embeddings", b"{not json",
                                   {"Content-Type": "application/json"})
    assert status == 400 and set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
    status, _, body = http_request(server.connection(), "GET", "/v1/embeddings")
    assert status == 405 and json.loads(body)["error"]["code"] == "method_not_allowed"
