"""Attacks on the generation server (issue 38): sampling settings read as something else, prompts that freeze the
event loop or reach a 500, a health check that names the served model to anyone, logprobs that show byte-level
pieces and drift on non-ASCII text; and, on the encoder server, an id past a table the file does not record."""

from __future__ import annotations

import json
import re
import threading
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.conftest import EVERY_POSITION
from tests.serving.helpers import Server

pytest.importorskip("torch")
openai = pytest.importorskip("openai")

NAME, KEY, MAX_LENGTH = "gpt", "a-generation-key-0123456789", 64
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXT = "the café sat on the mat — the dog ate crème brûlée . the cat sat ."
NON_ASCII = "the café — crème"  # é whole in one token; — and è split across tokens
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def byte_level_tokenizer(path):
    """GPT-2's kind of tokenizer (byte-level BPE) trained on TEXT, within TinyLM's 50 ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([TEXT] * 5, trainers.BpeTrainer(vocab_size=50, show_progress=False))
    tokenizer.save(str(path))
    return tokenizer


@pytest.fixture(scope="module")
def keyed(lm_cache, tmp_path_factory):
    """(server, tokenizer): TinyLM behind an API key, with a byte-level tokenizer and a 64-token maximum length."""
    folder = tmp_path_factory.mktemp("generation-attacks")
    tokenizer = byte_level_tokenizer(folder / "tokenizer.json")
    (folder / "keys").write_text(KEY + "\n")
    (folder / "chat.jinja").write_text(TEMPLATE)
    # --logits all: the echo tests score the prompt's own tokens
    server = Server(lm_cache("causal_lm", *EVERY_POSITION)[0], folder / "server.log", "--name", NAME,
                    "--threads", "1",
                    "--tokenizer", str(folder / "tokenizer.json"), "--chat-template", str(folder / "chat.jinja"),
                    "--api-key-file", str(folder / "keys"), "--max-length", str(MAX_LENGTH),
                    "--max-new-tokens", "32")
    try:
        yield server.wait_ready(), tokenizer
    finally:
        server.stop()


def api(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.url}/v1", api_key=KEY, max_retries=0, timeout=30)


def post(server: Server, path: str, body: dict | bytes, timeout: float = 30) -> tuple[int, dict]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, _, answer = server.request("POST", path, raw, {"Content-Type": "application/json", **AUTH},
                                       conn=server.connection(timeout))
    return status, json.loads(answer)


def generate(server: Server, body: dict | bytes) -> tuple[int, dict]:
    """Triton's generate extension, as its clients send it: the request's JSON to /v2/models/NAME/generate."""
    return post(server, f"/v2/models/{NAME}/generate", body)


# Defect 1: top_p 0 was read as 1 (`or 1.0`), a 200 with random draws; generate --top-p refuses 0.
def test_top_p_zero_is_refused_naming_the_field_on_every_route(keyed):
    server, _ = keyed
    client = api(server)
    calls = [lambda: client.completions.create(model=NAME, prompt="the cat", max_tokens=2, top_p=0),
             lambda: client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "the cat"}],
                                                    max_tokens=2, top_p=0)]
    for call in calls:
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert refused.value.param == "top_p" and "temperature 0" in refused.value.message
    status, answer = generate(server, {"text_input": "the cat", "parameters": {"max_tokens": 2, "top_p": 0}})
    assert status == 400 and answer["error"].startswith("top_p: must be a number in (0, 1]"), answer
    assert client.completions.create(model=NAME, prompt="the cat", max_tokens=2, top_p=1e-9).choices


# Defect 2: 8 MB of text was tokenized whole on the event loop (a 400 after 27 s, /healthz blocked meanwhile).
def test_a_huge_prompt_is_refused_at_once_while_health_checks_answer(keyed):
    server, _ = keyed
    huge = [("/v1/completions", {"model": NAME, "prompt": "the cat sat on the mat " * 400_000}),
            (f"/v2/models/{NAME}/generate", {"text_input": "crème brûlée " * 600_000}),
            ("/v1/completions", {"model": NAME, "prompt": [1] * 3_000_000})]
    for path, body in huge:
        answers, health = [], []

        def ask(path=path, body=body, answers=answers):
            start = time.perf_counter()
            answers.append((*post(server, path, body), time.perf_counter() - start))

        asking = threading.Thread(target=ask)
        asking.start()
        while asking.is_alive():
            start = time.perf_counter()
            health.append((server.request("GET", "/healthz", conn=server.connection(5))[0],
                           time.perf_counter() - start))
            time.sleep(0.05)
        asking.join()
        (status, answer, seconds), = answers
        message = answer.get("error", {}).get("message") if "completions" in path else answer.get("error")
        assert status == 400 and "maximum length" in message and seconds < 5, (path, status, message, seconds)
        assert all(code == 200 and took < 1.0 for code, took in health), health


def test_a_text_is_bounded_by_its_length_only_where_every_character_lands_in_a_token(tmp_path):
    """Where a tokenizer can drop characters or cover a run of unknown ones with one token, a long text may still
    be few tokens: no bound then, the text is tokenized (off the event loop)."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

    from mha_deploy.serving.http.text_bound import chars_per_token

    tokenizer = byte_level_tokenizer(tmp_path / "tokenizer.json")
    longest = max(map(len, tokenizer.get_vocab()))
    assert chars_per_token(tokenizer) == longest
    tokenizer.normalizer = normalizers.NFC()  # composes at most 4 characters into one
    assert chars_per_token(tokenizer) == 4 * longest
    tokenizer.normalizer = normalizers.Strip()  # 8 MB of spaces is nothing
    assert chars_per_token(tokenizer) is None
    tokenizer.normalizer = None
    tokenizer.add_tokens([AddedToken("<mask>", lstrip=True)])  # eats the spaces before it
    assert chars_per_token(tokenizer) is None
    word_level = Tokenizer(models.WordLevel({"the": 0, "[UNK]": 1}, unk_token="[UNK]"))  # one [UNK] per word
    assert chars_per_token(word_level) is None
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    assert chars_per_token(word_level) is None


# Defect 3: a caller without a key learnt the served name: 404 "this server serves 'gpt'" for any other name.
def test_a_keyless_health_check_answers_the_same_whatever_model_it_names(keyed):
    server, _ = keyed
    answers = [server.request("GET", path) for path in (f"/v2/models/{NAME}/ready", "/v2/models/WRONG/ready",
                                                        "/v2/models/WRONG/versions/7/ready")]
    assert {(status, body) for status, _, body in answers} == {(200, b'{"ready":true}')}
    status, _, body = server.request("GET", "/v2/models/WRONG/ready", headers=AUTH)
    assert status == 404 and f"serves '{NAME}'".encode() in body
    status, _, body = server.request("GET", f"/v2/models/{NAME}/ready", headers=AUTH)
    assert status == 200 and json.loads(body) == {"name": NAME, "ready": True}


# Weak 4: ids in [2^63, 2^64) overflowed int64: a 500 (plain text on Triton's generate).
@pytest.mark.parametrize("huge", [2**63, 2**64 - 1])
def test_prompt_ids_past_int64_are_a_400_naming_the_id(keyed, huge):
    server, _ = keyed
    with pytest.raises(openai.BadRequestError) as refused:
        api(server).completions.create(model=NAME, prompt=[1, huge], max_tokens=2)
    assert refused.value.param == "prompt" and f"token id {huge} is past" in refused.value.message
    status, answer = generate(server, {"input_ids": [huge, 1], "max_tokens": 2})
    assert status == 400 and f"token id {huge} is past" in answer["error"], answer


# Weak 5: a lone surrogate in a text prompt reached the tokenizer: a 500.
def test_a_lone_surrogate_in_a_text_prompt_is_a_400(keyed):
    server, _ = keyed
    status, answer = post(server, "/v1/completions", b'{"model": "gpt", "prompt": "the \\ud800 cat", "max_tokens": 2}')
    assert status == 400 and answer["error"]["param"] == "prompt" and "surrogate" in answer["error"]["message"]
    status, answer = post(server, "/v1/chat/completions",
                          b'{"model": "gpt", "messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}')
    assert status == 400 and answer["error"]["param"] == "messages", answer
    status, answer = generate(server, b'{"text_input": "cat \\ud800", "max_tokens": 2}')
    assert status == 400 and "surrogate" in answer["error"], answer


# Weak 6: seed 2^64 was refused as "got 1.8446744073709552e+19" (orjson reads it as a float).
def test_a_seed_past_64_bits_is_refused_with_the_range_and_the_integer_sent(keyed):
    server, _ = keyed
    for seed in (2**64, 2**64 + 1, 10**30):
        with pytest.raises(openai.BadRequestError) as refused:
            api(server).completions.create(model=NAME, prompt="the cat", max_tokens=2, seed=seed)
        assert refused.value.param == "seed"
        assert f"in [0, {2**64 - 1}], got {seed}" in refused.value.message, refused.value.message
    # The last seed takes several choices: choice i samples with (seed + i) mod 2**64, as generate's batches do.
    answer = api(server).completions.create(model=NAME, prompt="the cat", max_tokens=2, seed=2**64 - 1, n=2)
    assert [choice.finish_reason for choice in answer.choices] == ["length", "length"]


# Weak 7: Triton's generate sampled for "temperature": null, though the route's default is greedy.
def test_a_null_temperature_on_triton_generate_is_its_default_greedy(keyed):
    server, _ = keyed
    greedy = generate(server, {"input_ids": [1, 2, 3], "max_tokens": 16})[1]["output_ids"]
    for seed in (1, 2, 3):
        status, answer = generate(server, {"input_ids": [1, 2, 3], "max_tokens": 16, "temperature": None,
                                           "parameters": {"seed": seed}})
        assert status == 200 and answer["output_ids"] == greedy, (seed, answer)


def label_bytes(label: str) -> bytes:
    """The bytes of OpenAI's ``bytes:`` label: printable ASCII as is, the others ``\\xNN``."""
    escaped = label[len("bytes:"):]
    return re.sub(r"\\x([0-9a-f]{2})", lambda m: chr(int(m.group(1), 16)), escaped).encode("latin-1")


def assert_offsets_index_the_text(text: str, tokens: list[str], offsets: list[int]) -> None:
    """Each token shown as text sits at its offset. One shown as bytes starts with whole characters, which sit at its
    offset, followed by the start of another; or it starts inside a character, at which its offset points."""
    assert offsets == sorted(offsets) and len(offsets) == len(tokens)
    for token, offset in zip(tokens, offsets, strict=True):
        if not token.startswith("bytes:"):
            assert text[offset:offset + len(token)] == token, (token, offset, text)
            continue
        data = label_bytes(token)
        whole = next(n for n in range(len(data), -1, -1) if _decodes(data[:n]))
        lead = data[:whole].decode()
        assert text[offset:offset + len(lead)] == lead and not text[offset + len(lead)].isascii(), (token, offset)


def _decodes(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


# Weak 8: logprobs named tokens by their byte-level pieces ("Ġsat") and text_offset summed those, drifting.
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_logprobs_show_decoded_tokens_whose_offsets_index_a_non_ascii_text(keyed, stream):
    server, tokenizer = keyed
    settings = {"model": NAME, "prompt": NON_ASCII, "max_tokens": 12, "temperature": 0, "logprobs": 2, "echo": True}
    if stream:
        chunks = [c.choices[0] for c in api(server).completions.create(**settings, stream=True) if c.choices]
        fields = ("tokens", "text_offset", "top_logprobs")
        logprobs = {f: [v for c in chunks if c.logprobs for v in getattr(c.logprobs, f)] for f in fields}
        text = "".join(c.text for c in chunks)
    else:
        choice = api(server).completions.create(**settings).choices[0]
        logprobs, text = choice.logprobs.model_dump(), choice.text
    prompt = len(tokenizer.encode(NON_ASCII).ids)
    tokens = logprobs["tokens"]
    assert tokens[:prompt] == ["the", " c", "af", "é", "bytes: \\xe2\\x80", "bytes:\\x94", " c", "bytes:r\\xc3",
                               "bytes:\\xa8me"]
    assert not any("Ġ" in token for token in tokens)
    assert text.startswith(NON_ASCII) and logprobs["text_offset"][prompt] == len(NON_ASCII)
    assert_offsets_index_the_text(text, tokens, logprobs["text_offset"])
    assert not any("Ġ" in alternative for top in logprobs["top_logprobs"][1:] for alternative in top)


def test_chat_logprobs_bytes_are_each_tokens_own(keyed):
    """Chat's ``bytes`` were the UTF-8 of U+FFFD for a token holding part of a character."""
    server, tokenizer = keyed
    split = tokenizer.token_to_id("âĢ")  # the first two of the three bytes of "—"
    answer = api(server).chat.completions.create(model=NAME, messages=[{"role": "user", "content": NON_ASCII}],
                                                 max_tokens=3, temperature=0, logprobs=True,
                                                 logit_bias={str(split): 100})
    content, tokens = answer.choices[0].logprobs.content, answer.choices[0].token_ids
    assert tokens == [split] * 3 and [entry.token for entry in content] == ["bytes:\\xe2\\x80"] * 3
    assert [bytes(entry.bytes) for entry in content] == [b"\xe2\x80"] * 3


# Weak 9: a file recording no vocabulary, whose table is computed (no readable rows): an id past it reached ONNX
# Runtime's Gather and the server answered 500.
VOCAB, WIDTH = 1000, 8


def _computed_table_graph(path):
    """ids -> Gather from QuickGelu(a [1000, 8] table): the rows are an operator's output, which neither the
    metadata nor the graph's stored tables say; summed over the mask's real tokens -> output [batch, 8]."""
    from mha_deploy.exporters.export import set_metadata
    from mha_deploy.metadata import ModelMetadata
    from mha_deploy.signature import OUTPUT, PADDING_MASK, TOKENS, Signature, TensorSpec

    table = np.random.default_rng(0).standard_normal((VOCAB, WIDTH)).astype(np.float32)
    initializers = [numpy_helper.from_array(table, "stored"), numpy_helper.from_array(np.array([-1], np.int64), "last"),
                    numpy_helper.from_array(np.array([1], np.int64), "seq_axis")]
    nodes = [helper.make_node("QuickGelu", ["stored"], ["table"], domain="com.microsoft"),
             helper.make_node("Gather", ["table", "ids"], ["x"]),
             helper.make_node("Cast", ["mask"], ["mask_float"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["mask_float", "last"], ["mask3"]),
             helper.make_node("Mul", ["x", "mask3"], ["masked"]),
             helper.make_node("ReduceSum", ["masked", "seq_axis"], ["output"], keepdims=0)]
    graph = helper.make_graph(
        nodes, "computed-table",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("mask", TensorProto.BOOL, ["batch", "seq"])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", WIDTH])], initializers)
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18),
                                                                   helper.make_opsetid("com.microsoft", 1)])
    specs = (TensorSpec("ids", TOKENS, "int64", ("batch", "seq")),  # vocab None: not recorded
             TensorSpec("mask", PADDING_MASK, "bool", ("batch", "seq"), marks="ids"))
    output = TensorSpec("output", OUTPUT, "float32", ("batch", WIDTH))
    set_metadata(model, ModelMetadata(d_model=WIDTH, num_heads=1, signature=Signature.custom(specs, (output,))))
    onnx.save(model, str(path))
    return path


def test_an_id_past_a_table_no_file_records_is_400_on_rest_and_invalid_argument_on_grpc(tmp_path):
    tritonclient_grpc = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    path = _computed_table_graph(tmp_path / "computed.onnx")
    server = Server(path, tmp_path / "server.log", "--name", "computed", "--max-wait-ms", "20", grpc=True)
    try:
        server.wait_ready()
        client = tritonclient_grpc.InferenceServerClient(server.grpc_url)

        def rest(rows: list[list[int]]) -> tuple[int, bytes]:
            body = json.dumps({"inputs": [
                {"name": "ids", "shape": [len(rows), 2], "datatype": "INT64", "data": np.ravel(rows).tolist()},
                {"name": "mask", "shape": [len(rows), 2], "datatype": "BOOL", "data": [True] * 2 * len(rows)}]})
            status, _, answer = server.request("POST", "/v2/models/computed/infer", body.encode(),
                                               {"Content-Type": "application/json"})
            return status, answer

        assert rest([[5, 999]])[0] == 200
        for rows in ([[5, VOCAB]], [[5, 6], [VOCAB + 7, 1]]):  # alone, and beside a good row in one request
            bad = max(max(row) for row in rows)
            status, answer = rest(rows)
            assert status == 400 and f"ids holds id {bad}, past the table" in answer.decode(), (status, answer)
            tensors = [tritonclient_grpc.InferInput("ids", [len(rows), 2], "INT64"),
                       tritonclient_grpc.InferInput("mask", [len(rows), 2], "BOOL")]
            tensors[0].set_data_from_numpy(np.array(rows, np.int64))
            tensors[1].set_data_from_numpy(np.ones((len(rows), 2), bool))
            with pytest.raises(InferenceServerException, match=f"ids holds id {bad}") as refused:
                client.infer("computed", tensors)
            assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert rest([[5, 999]])[0] == 200  # the server serves on
    finally:
        server.stop()
