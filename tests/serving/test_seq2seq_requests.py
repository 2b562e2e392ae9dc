"""``mha-deploy serve`` of Hugging Face encoder-decoders exported with ``export --hf DIR --kv-cache`` (the files of
tests/exporters/test_hf_seq2seq_folders.py, exported once per run): what a request adds to its source, through the
official openai client's ``extra_body`` and Triton's generate route. M2M100: a per-request forced first token
(``forced_bos_token_id``, the target language; absent: the one recorded at export) and ``decoder_prompt``; Whisper:
its source as ``input_features`` (base64 float32 with its shape, or nested lists) with Whisper's decoder prompt.
Requests with different values run concurrently, so they share the engine's batch; each must get exactly the tokens
transformers' greedy ``generate`` gives that request alone (token ids compared exactly: tolerance 0). Bad values are
400s naming the field, and the server answers the next request."""

from __future__ import annotations

import base64
import functools
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("openai")

from tests.exporters import test_hf_seq2seq_folders as folders  # noqa: E402
from tests.serving.helpers import Server  # noqa: E402
from tests.serving.helpers import openai_client as client  # noqa: E402

NEW = folders.NEW_TOKENS
START, FORCED, OTHER, VOCAB = folders.START_ID, folders.FORCED_ID, folders.OTHER_LANGUAGE, folders.VOCAB
SOURCES = folders.SOURCES
WHISPER_PROMPT, TRANSCRIPT = folders.WHISPER_PROMPT, folders.TRANSCRIPT
TINY_VOCAB = 50  # tests/user_models/causal_lm.py's TinyLM


@pytest.fixture(scope="module")
def m2m100(tmp_path_factory):
    """(HF folder, server): M2M100 served with nothing but its file (encoder and ids found beside it)."""
    folder, path, _ = folders.export_m2m100(tmp_path_factory)
    server = Server(path, tmp_path_factory.mktemp("m2m-server") / "server.log", "--threads", "1", "--name", "m2m")
    try:
        yield folder, server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    folder, path, _ = folders.export_whisper(tmp_path_factory)
    server = Server(path, tmp_path_factory.mktemp("whisper-server") / "server.log", "--threads", "1", "--name",
                    "whisper")
    try:
        yield folder, server.wait_ready()
    finally:
        server.stop()


@functools.cache
def _m2m_module(folder):
    return transformers.M2M100ForConditionalGeneration.from_pretrained(folder, local_files_only=True).eval()


def _m2m_reference(folder, source: list[int], decoder: list[int] | None, forced: int) -> list[int]:
    """transformers' greedy generate on one source alone: its decoder prompt (the start id in front) or the start
    id alone with ``forced`` as the first token."""
    module = _m2m_module(folder)
    decoder = [START] if not decoder else decoder if decoder[0] == START else [START, *decoder]
    ids = torch.tensor([source])
    with torch.no_grad():
        out = module.generate(ids, attention_mask=torch.ones_like(ids), decoder_input_ids=torch.tensor([decoder]),
                              max_new_tokens=NEW, do_sample=False, num_beams=1, forced_bos_token_id=forced)
    return out[0, len(decoder):].tolist()


# (source key, extra_body, the forced id transformers is given): the recorded target language by default, another
# per request, a decoder prompt with a language of its own (not forced), a longer one beginning with the start id.
M2M_REQUESTS = [("a", {}, FORCED), ("b", {"forced_bos_token_id": OTHER}, OTHER),
                ("d", {"decoder_prompt": [OTHER]}, FORCED), ("e", {"decoder_prompt": [START, 30, 31]}, FORCED),
                ("c", {"forced_bos_token_id": 77}, 77)]


def test_m2m100_requests_with_their_own_target_language_share_the_batch_each_as_transformers_alone(m2m100):
    folder, server = m2m100
    openai = client(server)

    def ask(request):
        key, extra, _ = request
        return openai.completions.create(model="m2m", prompt=SOURCES[key], max_tokens=NEW, temperature=0,
                                         extra_body=extra or None)

    with ThreadPoolExecutor(len(M2M_REQUESTS)) as pool:
        answers = list(pool.map(ask, M2M_REQUESTS))
    for (key, extra, forced), answer in zip(M2M_REQUESTS, answers, strict=True):
        expected = _m2m_reference(folder, SOURCES[key], extra.get("decoder_prompt"), forced)
        assert answer.choices[0].token_ids == expected, (key, extra)
        if "decoder_prompt" not in extra:
            assert expected[0] == forced  # the row's own target language came first, no other row's
    # Triton's generate route takes the same fields
    status, _, raw = server.request("POST", "/v2/models/m2m/generate", json.dumps(
        {"input_ids": SOURCES["b"], "parameters": {"max_tokens": NEW, "decoder_prompt": [OTHER]}}).encode())
    assert status == 200, raw
    assert json.loads(raw)["output_ids"] == _m2m_reference(folder, SOURCES["b"], [OTHER], FORCED)
    # a list of prompts takes a list of decoder prompts, one each ([]: the start id alone, forced as recorded)
    decoders = {"d": [OTHER], "e": [START, 30, 31], "a": []}
    answer = openai.completions.create(model="m2m", prompt=[SOURCES[key] for key in decoders], max_tokens=NEW,
                                       temperature=0, extra_body={"decoder_prompt": list(decoders.values())})
    for choice, (key, decoder) in zip(answer.choices, decoders.items(), strict=True):
        assert choice.token_ids == _m2m_reference(folder, SOURCES[key], decoder, FORCED), key


def _base64(features: np.ndarray) -> dict:
    return {"shape": list(features.shape), "data": base64.b64encode(features.astype("<f4").tobytes()).decode()}


def test_whisper_features_through_the_server_equal_transformers(whisper):
    """Three items' features at once, base64 and nested lists, from the start id alone or Whisper's prompt (given
    whole, or without its start id): each equal to transformers' generation loop on that item alone, with the
    suppressed ids its generation config saved (recorded at export)."""
    folder, server = whisper
    features = folders._features(3, seed=9)
    requests = [(_base64(features[0]), None), (_base64(features[1]), WHISPER_PROMPT),
                (features[2].tolist(), WHISPER_PROMPT[1:])]
    openai = client(server)

    def ask(request):
        sent, decoder = request
        extra = {"input_features": sent, **({"decoder_prompt": decoder} if decoder else {})}
        return openai.completions.create(model="whisper", prompt=None, max_tokens=NEW, temperature=0,
                                         extra_body=extra)

    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(ask, requests))
    module = transformers.WhisperForConditionalGeneration.from_pretrained(folder, local_files_only=True).eval()
    for row, answer in enumerate(answers):
        decoder = [TRANSCRIPT] if row == 0 else WHISPER_PROMPT
        with torch.no_grad():  # transformers' loop (Whisper's own generate adds its timestamp logic)
            want = transformers.GenerationMixin.generate(
                module, torch.from_numpy(features[row : row + 1]), decoder_input_ids=torch.tensor([decoder]),
                max_new_tokens=NEW, num_beams=1, do_sample=False)
        assert answer.choices[0].token_ids == want[0, len(decoder):].tolist(), row
        assert answer.usage.prompt_tokens == 0  # features are no tokens
    assert len({tuple(answer.choices[0].token_ids) for answer in answers}) > 1  # the features and prompts matter
    # a batch of items in one request: a choice per item, as a list of prompts gives
    batch = openai.completions.create(model="whisper", prompt=None, max_tokens=NEW, temperature=0,
                                      extra_body={"input_features": _base64(features[:2])})
    assert batch.choices[0].token_ids == answers[0].choices[0].token_ids
    assert len(batch.choices) == 2
    status, _, raw = server.request("POST", "/v2/models/whisper/generate", json.dumps(
        {"input_features": _base64(features[1]), "parameters": {"max_tokens": NEW,
                                                                 "decoder_prompt": WHISPER_PROMPT}}).encode())
    assert status == 200 and json.loads(raw)["output_ids"] == answers[1].choices[0].token_ids, raw
    status, _, raw = server.request("GET", "/v2/models/whisper")
    assert json.loads(raw)["parameters"]["input_features"] == {
        "name": "input_features", "shape": [folders.MEL, 2 * folders.POSITIONS], "dtype": "float32"}


FRAMES = 2 * folders.POSITIONS
GOOD_FEATURES = _base64(np.zeros((folders.MEL, FRAMES), np.float32))
# (server, request body beyond model and max_tokens, the field the 400 names, words its message holds)
BAD = [
    ("m2m", {"prompt": [5, 6], "forced_bos_token_id": VOCAB}, "forced_bos_token_id", f"vocabulary of {VOCAB} ids"),
    ("m2m", {"prompt": [5, 6], "forced_bos_token_id": "en"}, "forced_bos_token_id", "integer"),
    ("m2m", {"prompt": [5, 6], "forced_bos_token_id": True}, "forced_bos_token_id", "integer"),
    ("m2m", {"prompt": [5, 6], "decoder_prompt": [START, VOCAB + 3]}, "decoder_prompt",
     f"token id {VOCAB + 3} is past the model's vocabulary of {VOCAB} ids (0 to {VOCAB - 1})"),
    ("m2m", {"prompt": [5, 6], "decoder_prompt": [START, -2]}, "decoder_prompt", "token id -2 is negative"),
    # one decoder prompt per prompt: as many as the prompts, each checked under its own index
    ("m2m", {"prompt": [[5, 6], [7, 8]], "decoder_prompt": [[OTHER]]}, "decoder_prompt",
     "1 decoder prompt for 2 prompts: give one list of token ids for every prompt, or one list per prompt"),
    ("m2m", {"prompt": [[5, 6], [7, 8]], "decoder_prompt": [[OTHER], OTHER]}, "decoder_prompt", "not a mix"),
    ("m2m", {"prompt": [[5, 6], [7, 8]], "decoder_prompt": [[OTHER], [START, VOCAB]]}, "decoder_prompt[1]",
     f"token id {VOCAB} is past the model's vocabulary of {VOCAB} ids"),
    ("m2m", {"prompt": [5, 6], "decoder_prompt": "en"}, "decoder_prompt", "list of token ids"),
    ("m2m", {"prompt": [5, 6], "decoder_prompt": [1.5]}, "decoder_prompt", "integers"),
    ("m2m", {"prompt": [5, 6], "decoder_prompt": [START] * 60, "max_tokens": 10}, "decoder_prompt",
     "recorded max length 64"),
    ("m2m", {"prompt": [5, 6], "input_features": GOOD_FEATURES}, "input_features", "token ids"),
    ("whisper", {"prompt": [5, 6]}, "input_features", f"features [{folders.MEL}, {FRAMES}]"),
    ("whisper", {"prompt": None, "input_features": _base64(np.zeros((folders.MEL, FRAMES - 2), np.float32))},
     "input_features", f"frames {FRAMES - 2} (expected {FRAMES})"),
    ("whisper", {"prompt": None, "input_features": {"shape": [folders.MEL, FRAMES], "data": "a!"}},
     "input_features", "base64"),
    ("whisper", {"prompt": None, "input_features": {"shape": [folders.MEL, FRAMES], "data": "AAAA"}},
     "input_features", "bytes"),
    ("whisper", {"prompt": None, "input_features": [[1.0, 2.0], [3.0]]}, "input_features", "numbers"),
    ("whisper", {"prompt": None, "input_features": _base64(np.full((folders.MEL, FRAMES), np.nan, np.float32))},
     "input_features", "NaN"),
    ("whisper", {"prompt": [5], "input_features": GOOD_FEATURES}, "prompt", "not both"),
    ("whisper", {"prompt": None, "input_features": GOOD_FEATURES, "decoder_prompt": {"a": 1}}, "decoder_prompt",
     "list"),
    ("tiny", {"prompt": [5, 6], "forced_bos_token_id": 3}, "forced_bos_token_id", "decoder-only"),
    ("tiny", {"prompt": [5, 6], "decoder_prompt": [3]}, "decoder_prompt", "decoder-only"),
    # every id a request gives is refused in the same words (runtime.logits.check_token_id), naming its own field
    ("tiny", {"prompt": [5, TINY_VOCAB]}, "prompt", f"token id {TINY_VOCAB} is past the model's vocabulary of "
                                                    f"{TINY_VOCAB} ids (0 to {TINY_VOCAB - 1}): was the prompt"),
    ("tiny", {"prompt": [5, 2**64]}, "prompt", f"token id {2**64} is past the model's vocabulary of {TINY_VOCAB}"),
    ("tiny", {"prompt": [[5, 6], [5, -1]]}, "prompt[1]", "token id -1 is negative"),
    ("tiny", {"prompt": [5, 6], "stop": [7, TINY_VOCAB + 1]}, "stop",
     f"token id {TINY_VOCAB + 1} is past the model's vocabulary of {TINY_VOCAB} ids"),
    ("tiny", {"prompt": [5, 6], "stop_token_ids": [-3]}, "stop_token_ids", "token id -3 is negative"),
    ("tiny", {"prompt": [5, 6], "logit_bias": {str(TINY_VOCAB): 1}}, "logit_bias",
     f"token id {TINY_VOCAB} is past the model's vocabulary of {TINY_VOCAB} ids"),
]


@pytest.fixture(scope="module")
def servers(m2m100, whisper, lm_cache, tmp_path_factory):
    tiny = Server(lm_cache("causal_lm")[0], tmp_path_factory.mktemp("tiny-server") / "server.log", "--threads", "1",
                  "--name", "tiny")
    try:
        yield {"m2m": m2m100[1], "whisper": whisper[1], "tiny": tiny.wait_ready()}
    finally:
        tiny.stop()


def test_bad_fields_are_400s_naming_the_field_and_the_server_keeps_answering(servers):
    for name, fields, param, words in BAD:
        server = servers[name]
        body = {"model": name, "max_tokens": 2, **fields}
        status, _, raw = server.request("POST", "/v1/completions", json.dumps(body).encode())
        error = json.loads(raw)["error"]
        assert (status, error["param"]) == (400, param), (fields, error)
        assert words in error["message"] and error["message"].startswith(param), (fields, error)
    # Triton's route: the v2 shape, the field named in its message
    status, _, raw = servers["m2m"].request("POST", "/v2/models/m2m/generate", json.dumps(
        {"input_ids": [5, 6], "parameters": {"decoder_prompt": [VOCAB]}}).encode())
    assert status == 400 and json.loads(raw)["error"].startswith("decoder_prompt:")
    for name, prompt, extra in (("m2m", [5, 6], None), ("whisper", None, {"input_features": GOOD_FEATURES}),
                                ("tiny", [5, 6], None)):
        answer = client(servers[name]).completions.create(model=name, prompt=prompt, max_tokens=2, temperature=0,
                                                          extra_body=extra)
        assert len(answer.choices[0].token_ids) >= 1


def test_the_engine_steps_rows_of_different_forced_ids_together_each_forced_alone(tmp_path_factory):
    """In the engine itself (no HTTP): requests queued before the loop starts are admitted in one turn and step in
    one cohort (as many turns as tokens, not one call per request), yet each row's first token is its own forced id
    and its tokens are transformers' for it alone."""
    from mha_deploy.runtime.generation import GenerationConfig
    from mha_deploy.runtime.kv_stepper import KVCacheStepper
    from mha_deploy.serving.engine import GenerationEngine, GenerationRequest

    folder, path, _ = folders.export_m2m100(tmp_path_factory)
    engine = GenerationEngine(KVCacheStepper(path))
    forced = [FORCED, OTHER, 77, None]  # None: the recorded one
    got: dict[int, list[int]] = {i: [] for i in range(len(forced))}
    for i, (key, token) in enumerate(zip("abcd", forced, strict=True)):
        config = GenerationConfig(max_new_tokens=NEW, forced_bos_token_id=token)
        engine.submit(GenerationRequest(np.asarray(SOURCES[key], np.int64), config),
                      lambda event, i=i: got[i].append(event.token))
    engine.start()
    engine.stop(timeout=60)
    assert engine.turns <= NEW  # every row stepped in the same turns
    for i, (key, token) in enumerate(zip("abcd", forced, strict=True)):
        assert got[i] == _m2m_reference(folder, SOURCES[key], None, token or FORCED), key
        assert got[i][0] == (token or FORCED)
