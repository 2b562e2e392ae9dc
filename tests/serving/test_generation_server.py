"""``mha-deploy serve`` of a KV-cache decoder: OpenAI's official client on /v1/completions and /v1/chat/completions,
plain and streaming, Triton's generate extension, against TinyLM (tests/user_models/causal_lm.py; fp32, and int4
weight-only for the completions) and Hugging Face GPT-2 from a config, each with a tokenizers tokenizer trained
here; every greedy completion equals the library's generation loop on the same prompt alone. Many concurrent
streams, cancellation, bad requests, metrics."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from mha_deploy.runtime.generation import generate
from mha_deploy.runtime.kv_stepper import KVCacheStepper
from tests.conftest import EVERY_POSITION
from tests.serving.helpers import Server
from tests.serving.helpers import openai_client as client

pytest.importorskip("torch")
openai = pytest.importorskip("openai")

TEXT = """the cat sat on the mat and the dog sat on the log . a bird sang in the tree while the sun rose over
the hill . the dog ran to the cat and the cat ran up the tree . the bird flew over the hill and the sun set ."""
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
            "{% if add_generation_prompt %}assistant : {% endif %}")
# user model, vocabulary, export flags beyond --kv-cache (tiny-int4: a weight-only int4 file served as it is)
# "tiny-scored": echo with logprobs scores the prompt's own tokens, which needs logits at every position
MODELS = {"tiny": ("causal_lm", 50), "gpt2": ("hf_gpt2", 96), "tiny-int4": ("causal_lm", 50, "--quantize", "int4"),
          "tiny-scored": ("causal_lm", 50, *EVERY_POSITION)}


def train_tokenizer(path, vocab: int):
    """A word-level tokenizer trained on TEXT, within the model's vocabulary."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from tokenizers.trainers import WordLevelTrainer

    tokenizer = Tokenizer(WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.train_from_iterator([TEXT], WordLevelTrainer(vocab_size=vocab, special_tokens=["[UNK]"]))
    tokenizer.save(str(path))
    return tokenizer


@pytest.fixture(scope="module")
def served(lm_cache, tmp_path_factory):
    """``served(key) -> (server, model path, tokenizer)``: one server per model for the module."""
    cache, servers = {}, []

    def start(key: str):
        if key not in cache:
            name, vocab, *flags = MODELS[key]
            path = lm_cache(name, *flags)[0]
            directory = tmp_path_factory.mktemp(f"gen-{key}")
            tokenizer = train_tokenizer(directory / "tokenizer.json", vocab)
            (directory / "chat.jinja").write_text(TEMPLATE)
            server = Server(path, directory / "server.log", "--tokenizer", str(directory / "tokenizer.json"),
                            "--chat-template", str(directory / "chat.jinja"), "--threads", "2", "--name", key,
                            "--max-new-tokens", "600", "--max-length", "700", "--max-choices", "4",
                            "--max-batch", "64")  # ragged files (the default): any lengths share one cache
            servers.append(server)
            cache[key] = server.wait_ready(), path, tokenizer
        return cache[key]

    yield start
    for server in servers:
        server.stop()


def alone(path, ids, max_new_tokens: int) -> list[int]:
    """The library loop on one prompt alone."""
    return generate(KVCacheStepper(path), [list(ids)], max_new_tokens=max_new_tokens).tokens[0].tolist()


def text_of(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


PROMPT = "the cat sat on the"


@pytest.mark.parametrize("key", list(MODELS))
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_completions_greedy_equal_the_library_loop(served, key, stream):
    server, path, tokenizer = served(key)
    expected = alone(path, tokenizer.encode(PROMPT).ids, 8)
    if stream:
        chunks = list(client(server).completions.create(model=key, prompt=PROMPT, max_tokens=8, temperature=0,
                                                         stream=True, stream_options={"include_usage": True}))
        tokens = [t for c in chunks if c.choices for t in c.choices[0].token_ids]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens == 8
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    else:
        answer = client(server).completions.create(model=key, prompt=PROMPT, max_tokens=8, temperature=0)
        tokens, text = answer.choices[0].token_ids, answer.choices[0].text
        assert answer.usage.prompt_tokens == len(tokenizer.encode(PROMPT).ids)
        assert answer.usage.completion_tokens == 8 and answer.choices[0].finish_reason == "length"
    assert tokens == expected
    assert text == text_of(tokenizer, expected)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_chat_completions_render_the_template_then_generate_as_the_library(served, stream):
    server, path, tokenizer = served("tiny")
    from jinja2 import Template

    messages = [{"role": "user", "content": "the dog ran"}]
    prompt = Template(TEMPLATE).render(messages=messages, add_generation_prompt=True)
    expected = alone(path, tokenizer.encode(prompt).ids, 6)
    chat = client(server).chat.completions
    if stream:
        chunks = list(chat.create(model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"
    else:
        answer = chat.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
        assert answer.choices[0].message.role == "assistant"
        text = answer.choices[0].message.content
        assert answer.choices[0].token_ids == expected
    assert text == text_of(tokenizer, expected)


def test_token_id_prompts_several_choices_stop_strings_and_logprobs(served):
    server, path, tokenizer = served("tiny")
    api = client(server).completions
    prompts = [[3, 4, 5], [7, 8]]
    answer = api.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0, n=2, logprobs=2)
    assert len(answer.choices) == 4
    for choice in answer.choices:
        assert choice.token_ids == alone(path, prompts[choice.index // 2], 5)
        assert len(choice.logprobs.token_logprobs) == 5 and len(choice.logprobs.top_logprobs[0]) == 2
    full = alone(path, [3, 4, 5], 10)
    words = text_of(tokenizer, full).split(" ")
    stop = " ".join(words[2:4])
    answer = api.create(model="tiny", prompt=[3, 4, 5], max_tokens=10, temperature=0, stop=[stop])
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].text == text_of(tokenizer, full)[: text_of(tokenizer, full).index(stop)]
    # stop ids end it at the id, kept (as an end id is)
    answer = api.create(model="tiny", prompt=[3, 4, 5], max_tokens=10, temperature=0, stop=[full[3]])
    assert answer.choices[0].token_ids == full[: full.index(full[3]) + 1]
    # sampling with a seed draws the same twice
    draws = [api.create(model="tiny", prompt=[3, 4, 5], max_tokens=6, temperature=0.9, top_p=0.9, seed=7)
             .choices[0].token_ids for _ in range(2)]
    assert draws[0] == draws[1]


MESSAGES = [{"role": "user", "content": "the dog ran"}]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_chat_logprobs_parse_into_the_clients_types_and_equal_the_completions_logprobs(served, stream):
    from jinja2 import Template
    from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionTokenLogprob

    server, _, tokenizer = served("tiny")
    prompt = Template(TEMPLATE).render(messages=MESSAGES, add_generation_prompt=True)
    api = client(server)
    plain = api.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=0)
    settings = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "logprobs": True,
                "top_logprobs": 20}
    if stream:
        chunks = list(api.chat.completions.create(**settings, stream=True))
        for chunk in chunks:  # strictly, as OpenAI's types declare them (the client itself does not validate)
            ChatCompletionChunk.model_validate(chunk.model_dump())
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        tokens = [t for c in chunks[1:] for t in c.choices[0].token_ids]  # after the role's chunk
    else:
        answer = api.chat.completions.create(**settings)
        ChatCompletion.model_validate(answer.model_dump())
        entries, tokens = answer.choices[0].logprobs.content, answer.choices[0].token_ids
    assert tokens == plain.choices[0].token_ids and len(entries) == 6
    for entry, token, logprob in zip(entries, tokens, plain.choices[0].logprobs.token_logprobs, strict=True):
        assert isinstance(entry, ChatCompletionTokenLogprob)
        # the text it decodes to alone; an id the tokenizer lacks (TinyLM's vocabulary is larger) is its digits
        assert entry.token == (text_of(tokenizer, [token]) or str(token))
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(logprob, abs=1e-6)  # one computation, two shapes
        top = [t.logprob for t in entry.top_logprobs]
        assert len(top) == 20 and top == sorted(top, reverse=True)
        assert entry.top_logprobs[0].token == entry.token and top[0] == entry.logprob  # greedy: the likeliest
    answer = api.chat.completions.create(**{**settings, "top_logprobs": 0})
    assert [e.top_logprobs for e in answer.choices[0].logprobs.content] == [[]] * 6
    assert api.chat.completions.create(**{**settings, "logprobs": False, "top_logprobs": None}).choices[0].logprobs \
        is None


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_echo_starts_each_choice_with_its_prompt(served, stream):
    server, _, tokenizer = served("tiny")
    api = client(server).completions
    prompts = [PROMPT, [7, 8, 9]]  # text as given; ids as their text
    plain = api.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0)
    echoes = [PROMPT, text_of(tokenizer, [7, 8, 9])]
    expected = [echo + choice.text for echo, choice in zip(echoes, plain.choices, strict=True)]
    if stream:
        chunks = list(api.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0, echo=True, stream=True))
        for index in range(2):
            texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index]
            assert texts[0] == echoes[index]  # the prompt first, as OpenAI streams it
            assert "".join(texts) == expected[index]
    else:
        answer = api.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0, echo=True)
        assert [c.text for c in answer.choices] == expected
        assert [c.token_ids for c in answer.choices] == [c.token_ids for c in plain.choices]  # generated ids only
        assert answer.usage == plain.usage


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_echo_with_logprobs_scores_the_prompt_with_the_models_own_logits(served, stream):
    from tests.serving.test_generation_engine import torch_log_probs

    server, _, tokenizer = served("tiny-scored")
    api = client(server).completions
    prompt = [3, 4, 5, 9, 12]
    plain = api.create(model="tiny-scored", prompt=prompt, max_tokens=4, temperature=0, logprobs=3)
    settings = {"model": "tiny-scored", "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 3,
                "echo": True}
    if stream:
        chunks = [c.choices[0] for c in api.create(**settings, stream=True) if c.choices]
        fields = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        logprobs = {f: [v for c in chunks if c.logprobs for v in getattr(c.logprobs, f)] for f in fields}
        text = "".join(c.text for c in chunks)
    else:
        choice = api.create(**settings).choices[0]
        logprobs, text = choice.logprobs.model_dump(), choice.text
    echo = text_of(tokenizer, prompt)
    assert text == echo + plain.choices[0].text
    expected = torch_log_probs(prompt)  # TinyLM's own logits in torch, log-softmaxed in numpy
    def piece(token) -> str:  # completions name a token by its piece, an id the tokenizer lacks by its digits
        return tokenizer.id_to_token(int(token)) or str(token)

    assert logprobs["tokens"][:5] == [piece(t) for t in prompt]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for i in range(1, 5):  # float32 ORT against torch
        assert logprobs["token_logprobs"][i] == pytest.approx(expected[i - 1, prompt[i]], abs=1e-4)
        top = logprobs["top_logprobs"][i]
        assert list(top) == [piece(t) for t in np.argsort(-expected[i - 1], kind="stable")[:3]]
        assert list(top.values()) == pytest.approx(np.sort(expected[i - 1])[::-1][:3], abs=1e-4)
    generated = plain.choices[0].logprobs
    assert logprobs["tokens"][5:] == generated.tokens and logprobs["top_logprobs"][5:] == generated.top_logprobs
    assert logprobs["token_logprobs"][5:] == pytest.approx(generated.token_logprobs, abs=1e-6)
    for token_id, token, offset in zip(prompt, logprobs["tokens"][:5], logprobs["text_offset"][:5], strict=True):
        # each token where its text is in the echo (the word-level decoder puts spaces between them)
        assert echo[offset:offset + len(token)] == token or tokenizer.id_to_token(token_id) is None
    assert logprobs["text_offset"][5] == len(echo)  # the generated text starts after the prompt's

def test_triton_generate_and_generate_stream(served):
    server, path, tokenizer = served("gpt2")
    expected = alone(path, tokenizer.encode(PROMPT).ids, 6)
    status, _, body = server.request("POST", "/v2/models/gpt2/generate",
                                     json.dumps({"text_input": PROMPT, "parameters": {"max_tokens": 6}}).encode())
    assert status == 200, body
    answer = json.loads(body)
    assert answer["model_name"] == "gpt2" and answer["output_ids"] == expected
    assert answer["text_output"] == text_of(tokenizer, expected)
    status, headers, body = server.request("POST", "/v2/models/gpt2/generate_stream",
                                           json.dumps({"text_input": PROMPT, "max_tokens": 6}).encode())
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in body.decode().split("\n\n") if line.startswith("data: ")]
    assert [t for e in events for t in e["output_ids"]] == expected
    assert "".join(e["text_output"] for e in events) == text_of(tokenizer, expected)
    status, _, body = server.request("POST", "/v2/models/gpt2/infer", b"{}")
    assert status == 400 and b"generate" in body
    status, _, body = server.request("GET", "/v2/models/gpt2")
    meta = json.loads(body)
    assert meta["parameters"]["generator"] and "ragged cache" in meta["parameters"]["batching"]


PENALISED = [  # (request settings, the same as GenerationConfig fields)
    ({"frequency_penalty": 2.0}, {"frequency_penalty": 2.0}),
    ({"presence_penalty": -1.5, "frequency_penalty": 0.5, "logit_bias": {"9": -100, "21": 3.5}},
     {"presence_penalty": -1.5, "frequency_penalty": 0.5, "logit_bias": {9: -100, 21: 3.5}}),
    ({}, {}),
]


def test_requests_with_different_penalties_share_the_batch_each_equal_to_its_request_alone(served):
    server, path, _ = served("tiny")
    prompt, steps = [11, 3, 3, 8, 1, 40, 7], 40  # long enough that the three overlap in the running batch
    expected = [generate(KVCacheStepper(path), [prompt], max_new_tokens=steps, **config).tokens[0].tolist()
                for _, config in PENALISED]
    assert len({tuple(e) for e in expected}) == len(expected)  # the settings change the output
    start = threading.Barrier(len(PENALISED))

    def ask(settings):
        start.wait()
        return client(server).completions.create(model="tiny", prompt=prompt, max_tokens=steps, temperature=0,
                                                  **settings).choices[0].token_ids

    with ThreadPoolExecutor(len(PENALISED)) as pool:
        got = list(pool.map(ask, [settings for settings, _ in PENALISED]))
    assert got == expected


def test_logit_bias_on_chat_and_triton_generate(served):
    server, _, _ = served("tiny")
    answer = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "the dog ran"}], max_tokens=5, temperature=0,
        logit_bias={"12": 100})
    assert answer.choices[0].token_ids == [12] * 5
    body = {"input_ids": [3, 4, 5], "parameters": {"max_tokens": 4, "logit_bias": {"30": 100},
                                                     "frequency_penalty": 1.0}}
    status, _, raw = server.request("POST", "/v2/models/tiny/generate", json.dumps(body).encode())
    assert status == 200 and json.loads(raw)["output_ids"] == [30] * 4
    body["parameters"]["presence_penalty"] = 3
    status, _, raw = server.request("POST", "/v2/models/tiny/generate", json.dumps(body).encode())
    assert status == 400 and "presence_penalty" in json.loads(raw)["error"]


def test_32_concurrent_streams_each_equal_to_its_request_alone(served):
    server, path, _ = served("tiny")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 50, rng.integers(1, 40)).tolist() for _ in range(32)]
    lengths = rng.integers(1, 17, 32).tolist()
    api = client(server).completions

    def run(i):
        stream = api.create(model="tiny", prompt=prompts[i], max_tokens=lengths[i], temperature=0, stream=True)
        return [t for chunk in stream for t in chunk.choices[0].token_ids]

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(run, range(32)))
    for prompt, n, tokens in zip(prompts, lengths, results, strict=True):
        assert tokens == alone(path, prompt, n)


def metric(server: Server, name: str) -> float:
    text = server.request("GET", "/metrics")[2].decode()
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(match.group(1))


def test_cancelled_streams_free_their_cache_and_the_others_complete(served):
    server, path, _ = served("tiny")
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 50, rng.integers(2, 20)).tolist() for _ in range(16)]
    api = client(server).completions
    before = metric(server, "mha_generation_tokens_total")
    two_read = threading.Barrier(9)

    def cancelled(i):  # asks for 600 tokens, reads two, goes away
        stream = api.create(model="tiny", prompt=prompts[i], max_tokens=600, temperature=0, stream=True)
        chunks = iter(stream)
        next(chunks), next(chunks)
        two_read.wait(30)
        stream.close()

    def finished(i):
        stream = api.create(model="tiny", prompt=prompts[i], max_tokens=12, temperature=0, stream=True)
        return [t for chunk in stream for t in chunk.choices[0].token_ids]

    with ThreadPoolExecutor(16) as pool:
        gone = [pool.submit(cancelled, i) for i in range(8)]
        two_read.wait(30)  # every cancelled stream is running (two tokens read) before the others start
        kept = [pool.submit(finished, i) for i in range(8, 16)]
        for future in gone:
            future.result()
        results = [future.result() for future in kept]
    for i, tokens in zip(range(8, 16), results, strict=True):
        assert tokens == alone(path, prompts[i], 12)
    deadline = time.monotonic() + 10
    while metric(server, "mha_generation_cache_tokens") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "mha_generation_cache_tokens") == 0
    assert metric(server, "mha_generation_running_requests") == 0
    generated = metric(server, "mha_generation_tokens_total") - before
    assert generated < 8 * 12 + 8 * 300, f"{generated} tokens: the cancelled streams ran on"
    text = server.request("GET", "/metrics")[2].decode()
    assert "mha_generation_time_to_first_token_seconds_count" in text
    assert "mha_generation_time_per_output_token_seconds_count" in text


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": "nope", "prompt": [1]}, 404, "model"),
    ({"model": "tiny", "prompt": [1], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": [1], "max_tokens": 601}, 400, None),
    ({"model": "tiny", "prompt": [1] * 690, "max_tokens": 16}, 400, None),
    ({"model": "tiny", "prompt": [1, 50], "max_tokens": 4}, 400, None),
    ({"model": "tiny", "prompt": [1], "n": 5}, 400, "n"),
    ({"model": "tiny", "prompt": [1], "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "prompt": [1], "echo": 1}, 400, "echo"),
    ({"model": "tiny", "prompt": [1], "suffix": "the end"}, 400, "suffix"),
    ({"model": "tiny", "prompt": [1], "logprobs": 6}, 400, "logprobs"),
    ({"model": "tiny"}, 400, "prompt"),
    ({"model": "tiny", "prompt": [1], "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"model": "tiny", "prompt": [1], "frequency_penalty": -3}, 400, "frequency_penalty"),
    ({"model": "tiny", "prompt": [1], "frequency_penalty": "1"}, 400, "frequency_penalty"),
    ({"model": "tiny", "prompt": [1], "logit_bias": {"3": 150}}, 400, "logit_bias"),
    ({"model": "tiny", "prompt": [1], "logit_bias": {"x3": 1}}, 400, "logit_bias"),
    ({"model": "tiny", "prompt": [1], "logit_bias": {"50": 1}}, 400, "logit_bias"),
    ({"model": "tiny", "prompt": [1], "logit_bias": [3]}, 400, "logit_bias"),
], ids=["unknown-model", "max-tokens-0", "max-tokens-past-limit", "past-max-length", "id-past-vocab", "n-too-large",
        "bad-temperature", "echo-not-a-boolean", "suffix", "logprobs-past-5",
        "no-prompt", "presence-too-high", "frequency-too-low", "frequency-a-string",
        "bias-too-high", "bias-key-not-an-id", "bias-id-past-vocab", "bias-not-an-object"])
def test_bad_requests_get_openai_shaped_errors(served, body, status, param):
    server, _, _ = served("tiny")
    got, _, raw = server.request("POST", "/v1/completions", json.dumps(body).encode())
    error = json.loads(raw)["error"]
    assert got == status, error
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    if "prompt" not in body:
        return  # the official client refuses it before sending
    # the official client raises the matching error with the server's message
    failure = openai.NotFoundError if status == 404 else openai.BadRequestError
    with pytest.raises(failure, match=re.escape(error["message"][:40])):
        client(server).completions.create(**body)



@pytest.mark.parametrize(("fields", "param"), [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs"),
], ids=["top-without-logprobs", "top-with-logprobs-false", "top-past-20", "top-negative", "logprobs-a-count"])
def test_bad_chat_logprobs_get_openai_shaped_errors(served, fields, param):
    server, _, _ = served("tiny")
    body = {"model": "tiny", "messages": MESSAGES, **fields}
    got, _, raw = server.request("POST", "/v1/chat/completions", json.dumps(body).encode())
    error = json.loads(raw)["error"]
    assert got == 400 and error["param"] == param and error["type"] == "invalid_request_error", error
    with pytest.raises(openai.BadRequestError, match=re.escape(error["message"][:40])):
        client(server).chat.completions.create(**body)

def test_malformed_json_and_a_chat_without_template(served, tmp_path):
    server, path, _ = served("tiny")
    status, _, raw = server.request("POST", "/v1/completions", b'{"model": "tiny", "prompt": [1,')
    assert status == 400 and json.loads(raw)["error"]["code"] == "malformed_json"
    bare = Server(path, tmp_path / "bare.log", "--threads", "1", "--name", "bare", "--max-batch", "1",
                  "--max-queue", "1", "--mix-lengths").wait_ready()
    try:
        status, _, raw = bare.request("POST", "/v1/chat/completions", json.dumps(
            {"model": "bare", "messages": [{"role": "user", "content": "hi"}]}).encode())
        assert status == 404 and "--chat-template" in json.loads(raw)["error"]["message"]
        status, _, raw = bare.request("POST", "/v1/completions", json.dumps({"model": "bare", "prompt": "hi"}).encode())
        assert status == 400 and "--tokenizer" in json.loads(raw)["error"]["message"]
        # one running, one waiting: a third gets 429 with Retry-After, never a hang
        body = json.dumps({"model": "bare", "prompt": [1, 2], "max_tokens": 600, "temperature": 0}).encode()
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda _: bare.request("POST", "/v1/completions", body), range(3)))
        refused = [a for a in answers if a[0] == 429]
        assert refused and refused[0][1]["retry-after"] == "1"
        assert all(a[0] in (200, 429) for a in answers)
    finally:
        bare.stop()


def test_api_keys_guard_the_generation_routes(lm_cache, tmp_path):
    path = lm_cache("causal_lm")[0]
    keys = tmp_path / "keys"
    keys.write_text("a-generation-key-0123456789\n")
    server = Server(path, tmp_path / "keyed.log", "--threads", "1", "--name", "keyed", "--mix-lengths",
                    "--api-key-file", str(keys)).wait_ready()
    try:
        status, _, raw = server.request("POST", "/v1/completions", b'{"model": "keyed", "prompt": [1]}')
        assert status == 401 and set(json.loads(raw)["error"]) == {"message", "type", "param", "code"}
        with pytest.raises(openai.AuthenticationError):
            client(server).models.list()
        keyed = openai.OpenAI(base_url=f"http://{server.url}/v1", api_key="a-generation-key-0123456789",
                              max_retries=0)
        answer = keyed.completions.create(model="keyed", prompt=[1, 2], max_tokens=3, temperature=0)
        assert answer.choices[0].token_ids == alone(path, [1, 2], 3)
        assert server.request("GET", "/v2/models/keyed/generate")[0] == 401
    finally:
        server.stop()


def test_eos_ids_recorded_at_export_end_completions(lm_cache, tmp_path):
    from click.testing import CliRunner

    from mha_deploy.cli import main
    from tests.conftest import USER_MODELS, user_module

    full = alone(lm_cache("causal_lm")[0], [3, 4, 5], 10)
    eos = full[2]
    path = tmp_path / "lm-eos.onnx"
    inputs = [arg for spec in user_module("causal_lm").INPUTS for arg in ("--input", spec)]
    result = CliRunner().invoke(main, ["export", "--module", f"{USER_MODELS / 'causal_lm'}.py:build", *inputs,
                                       "--kv-cache", "--eos-id", str(eos), "-o", str(path)])
    assert result.exit_code == 0, result.output
    server = Server(path, tmp_path / "eos.log", "--threads", "1", "--name", "eos", "--mix-lengths").wait_ready()
    try:
        answer = client(server).completions.create(model="eos", prompt=[3, 4, 5], max_tokens=10, temperature=0)
        assert answer.choices[0].token_ids == full[: full.index(eos) + 1]
        assert answer.choices[0].finish_reason == "stop"
        assert f"eos ids {eos}" in server.log()
    finally:
        server.stop()


def test_an_encoder_decoder_is_served_with_its_source_as_the_prompt(seq2seq, tmp_path):
    decoder, encoder, start, vocab = seq2seq
    server = Server(decoder, tmp_path / "seq2seq.log", "--threads", "1", "--name", "s2s", "--encoder", str(encoder),
                    "--start-id", str(start)).wait_ready()
    try:
        sources = [[5, 6, 7, 8], [9, 3]]
        answer = client(server).completions.create(model="s2s", prompt=sources, max_tokens=5, temperature=0)
        stepper = KVCacheStepper(decoder, encoder=encoder, decoder_start_token_id=start)
        for choice in answer.choices:
            expected = generate(stepper, [sources[choice.index]], max_new_tokens=5).tokens[0].tolist()
            assert choice.token_ids == expected
        status, _, raw = server.request("POST", "/v1/completions",
                                        json.dumps({"model": "s2s", "prompt": [vocab]}).encode())
        assert status == 400 and "vocabulary" in json.loads(raw)["error"]["message"]
        # its prompt is the encoder's source: echo is taken, but no logits score the source
        status, _, raw = server.request("POST", "/v1/completions", json.dumps(
            {"model": "s2s", "prompt": [5, 6], "max_tokens": 2, "echo": True, "logprobs": 1}).encode())
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == "echo" and "logprobs" in error["message"]
        echoed = client(server).completions.create(model="s2s", prompt=[5, 6], max_tokens=2, temperature=0,
                                                    echo=True)
        assert echoed.choices[0].token_ids == generate(stepper, [[5, 6]], max_new_tokens=2).tokens[0].tolist()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tutorial_pair(tmp_path_factory):
    """The tutorial encoder-decoder (tests/user_models/seq2seq.py) as ``export --kv-cache`` writes it: ``mt.onnx``
    (the decoder) naming ``mt.encoder.onnx`` beside it, with a start id, an eos id and a max length recorded."""
    from click.testing import CliRunner

    from mha_deploy.cli import main
    from tests.conftest import USER_MODELS, user_module

    path = tmp_path_factory.mktemp("served-pair") / "mt.onnx"
    inputs = [arg for spec in user_module("seq2seq").INPUTS for arg in ("--input", spec)]
    result = CliRunner().invoke(main, ["export", "--module", f"{USER_MODELS / 'seq2seq'}.py:build", *inputs,
                                       "--kv-cache", "--start-id", "1", "--eos-id", "6", "--max-length", "24",
                                       "-o", str(path)])
    assert result.exit_code == 0, result.output
    return path


def test_an_exported_pair_is_served_from_its_decoder_alone(tutorial_pair, tmp_path):
    server = Server(tutorial_pair, tmp_path / "pair.log", "--threads", "1", "--name", "mt").wait_ready()
    try:
        assert f"encoder {tutorial_pair.with_name('mt.encoder.onnx')} (named by mt.onnx)" in server.log()
        status, _, raw = server.request("GET", "/v2/models/mt")
        described = json.loads(raw)["parameters"]
        assert status == 200 and described["encoder_decoder"] is True
        assert described["encoder"] == str(tutorial_pair.with_name("mt.encoder.onnx"))
        assert described["decoder_start_token_id"] == 1 and described["eos_token_ids"] == [6]
        assert described["max_length"] == 24 and described["max_target_tokens"] == 24
        assert "sources of any length share a cohort" in described["batching"]
        # Four sources of different lengths at once: the decoder masks shorter sources (encoder_attention_mask),
        # so they may share steps; each completion must still be what the library loop gives that source alone.
        sources = [[5, 6, 7], [4, 5, 6, 7, 8, 9], [9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
        openai_client = client(server)

        def complete(source):
            return openai_client.completions.create(model="mt", prompt=source, max_tokens=10, temperature=0)

        with ThreadPoolExecutor(len(sources)) as pool:
            answers = list(pool.map(complete, sources))
        for source, answer in zip(sources, answers, strict=True):
            stepper = KVCacheStepper(tutorial_pair)  # finds its encoder and start id, as the server does
            expected = generate(stepper, [source], max_new_tokens=10, eos_token_id=[6]).tokens[0].tolist()
            choice = answer.choices[0]
            assert choice.token_ids == expected, source
            assert choice.finish_reason == ("stop" if expected[-1] == 6 else "length")
            assert answer.usage.prompt_tokens == len(source)
        # the decoder's position table holds 24 target tokens: more is refused, naming why
        status, _, raw = server.request("POST", "/v1/completions",
                                        json.dumps({"model": "mt", "prompt": [5], "max_tokens": 25}).encode())
        assert status == 400 and "recorded max length" in json.loads(raw)["error"]["message"]
    finally:
        server.stop()


def test_serving_a_pairs_encoder_names_its_decoder(tutorial_pair):
    from click.testing import CliRunner

    from mha_deploy.cli import main

    encoder = tutorial_pair.with_name("mt.encoder.onnx")
    result = CliRunner().invoke(main, ["serve", str(encoder), "--port", "0"])
    assert result.exit_code == 1
    assert f"{encoder} is the encoder of an encoder-decoder: give its decoder, {tutorial_pair}" in result.output
