"""The continuous-batching engine (serving.engine) over TinyLM exported with a KV cache: requests joining and
leaving one running batch get exactly the tokens they get alone; per-request settings; cancellation; the budget.
And the stepper's own join / extend / fork (runtime.kv_stepper)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from mha_deploy.errors import InputError
from mha_deploy.runtime.generation import GenerationConfig, generate
from mha_deploy.runtime.kv_stepper import KVCacheStepper
from mha_deploy.serving.engine import (
    EngineBusy,
    GenerationEngine,
    GenerationRequest,
    RequestTooLarge,
)
from mha_deploy.serving.scheduler import KVBudget
from tests.conftest import EVERY_POSITION, HOLES_EVERY_POSITION, HOLES_LM

pytest.importorskip("torch")

VOCAB = 50  # TinyLM's


@pytest.fixture(scope="module")
def tiny(lm_cache):
    return lm_cache("causal_lm")[0]  # what users get: the ragged layout


@pytest.fixture(scope="module")
def tiny_holes(lm_cache):
    return lm_cache("causal_lm", *HOLES_LM)[0]  # `export --cache-layout holes`


@pytest.fixture
def tiny_scored(lm_cache):
    return lm_cache("causal_lm", *EVERY_POSITION)[0]  # logits at every position: what scoring a prompt reads


@pytest.fixture
def tiny_holes_scored(lm_cache):
    return lm_cache("causal_lm", *HOLES_EVERY_POSITION)[0]


def alone(path, prompt, **options) -> list[int]:
    return generate(KVCacheStepper(path), [prompt], **options).tokens[0].tolist()


def served(engine: GenerationEngine, requests: list[GenerationRequest]) -> list[list[int]]:
    """``run_all`` on the engine's own decode thread, started for it and stopped after."""
    engine.start()
    try:
        return run_all(engine, requests)
    finally:
        engine.stop(10)


def run_all(engine: GenerationEngine, requests: list[GenerationRequest], timeout: float = 60) -> list[list[int]]:
    """Every request submitted at once; their tokens, each request's in order."""
    results = [[] for _ in requests]
    done = [threading.Event() for _ in requests]

    def listener(i):
        def notify(event):
            assert event.error is None, event.error
            results[i].append(event.token)
            if event.finish_reason:
                done[i].set()
        return notify

    for i, request in enumerate(requests):
        engine.submit(request, listener(i))
    for event in done:
        assert event.wait(timeout)
    return results


def events_of(engine: GenerationEngine, request: GenerationRequest, timeout: float = 30) -> list:
    """``request`` submitted to a started ``engine``: every event it got, the last one with its finish reason."""
    events, finished = [], threading.Event()

    def notify(event):
        events.append(event)
        if event.finish_reason:
            finished.set()

    engine.submit(request, notify)
    assert finished.wait(timeout)
    return events


def prompts(count, seed, longest=20):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, rng.integers(1, longest + 1)).astype(np.int64) for _ in range(count)]


def test_join_pads_the_narrower_cache_with_holes_and_each_row_continues_as_alone(tiny_holes):
    tiny = tiny_holes
    stepper = KVCacheStepper(tiny)
    short, long = np.array([[3, 4]]), np.array([[5, 6, 7, 8, 9]])
    stepper.prefill(short, np.ones_like(short))
    other = stepper.fork()
    assert other.rows == 0 and other.graph is stepper.graph
    other.prefill(long, np.ones_like(long))
    stepper.join(other)
    assert other.rows == 0 and stepper.rows == 2
    assert stepper.mask.tolist() == [[0, 0, 0, 1, 1], [1, 1, 1, 1, 1]]
    assert stepper.cache_positions == 10
    logits = stepper.step(np.array([1, 2]))
    for row, (prompt, token) in enumerate([(short, 1), (long, 2)]):
        single = KVCacheStepper(tiny)
        single.prefill(prompt, np.ones_like(prompt))
        np.testing.assert_allclose(logits[row], single.step(np.array([token]))[0], atol=1e-5, rtol=1e-5)


def test_extend_prefills_in_chunks_as_one_prefill_does(tiny):
    prompt = np.arange(1, 13)[None, :]
    whole = KVCacheStepper(tiny)
    expected = whole.prefill(prompt, np.ones_like(prompt))
    chunked = KVCacheStepper(tiny)
    chunked.prefill(prompt[:, :5], np.ones((1, 5), np.int64))
    chunked.extend(prompt[:, 5:9])
    got = chunked.extend(prompt[:, 9:])
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(Exception, match="past the vocabulary"):
        chunked.extend(np.array([[VOCAB]]))


def test_a_model_whose_export_measured_no_positions_mixes_lengths_by_default(tiny_holes):
    """TinyLM has no positions: its holes export records positions "none", so rows of any length share one cohort
    (holes do not shift them)."""
    engine = GenerationEngine(KVCacheStepper(tiny_holes))
    assert engine.stepper.graph.positions == "none"
    assert engine.mix_lengths and "does not change it" in engine.batching


@pytest.mark.parametrize("mix", [True, False], ids=["mixed-lengths", "aligned-cohorts"])
def test_greedy_requests_sharing_the_loop_equal_each_alone(tiny, mix):
    given = prompts(12, seed=0)
    lengths = [3 + i % 6 for i in range(len(given))]
    # a small prefill chunk: long prompts prefill over several turns while others step
    engine = GenerationEngine(KVCacheStepper(tiny), max_kv_tokens=4096, prefill_chunk=7, mix_lengths=mix)
    assert ("by length" in engine.batching) != mix and "ragged cache" in engine.batching  # says which it does
    got = served(engine, [GenerationRequest(p, GenerationConfig(max_new_tokens=n))
                           for p, n in zip(given, lengths, strict=True)])
    for prompt, n, tokens in zip(given, lengths, got, strict=True):
        assert tokens == alone(tiny, prompt.tolist(), max_new_tokens=n)
    assert engine.snapshot() == {"running": 0, "waiting": 0, "cache_positions": 0}


def test_per_request_settings_in_one_batch(tiny):
    given = prompts(4, seed=1)
    configs = [GenerationConfig(max_new_tokens=6),
               GenerationConfig(max_new_tokens=6, do_sample=True, temperature=0.7, top_k=10, seed=5),
               GenerationConfig(max_new_tokens=6, do_sample=True, top_p=0.8, seed=9),
               GenerationConfig(max_new_tokens=6, repetition_penalty=1.3)]
    full = alone(tiny, given[0].tolist(), max_new_tokens=6)
    stop = full[2]
    configs[0] = GenerationConfig(max_new_tokens=6, eos_token_id=stop)
    engine = GenerationEngine(KVCacheStepper(tiny), mix_lengths=True)
    got = served(engine, [GenerationRequest(p, c) for p, c in zip(given, configs, strict=True)])
    assert got[0] == full[: full.index(stop) + 1]
    for prompt, config, tokens in zip(given[1:], configs[1:], got[1:], strict=True):
        assert tokens == generate(KVCacheStepper(tiny), [prompt.tolist()], config=config).tokens[0].tolist()


def test_per_request_penalties_and_logit_bias_in_one_batch(tiny):
    """Rows sharing a step each apply their own presence / frequency penalties and logit_bias, counted over their own
    completions: each equals its request alone."""
    given = prompts(5, seed=3)
    configs = [GenerationConfig(max_new_tokens=10),
               GenerationConfig(max_new_tokens=10, frequency_penalty=2.0),
               GenerationConfig(max_new_tokens=10, presence_penalty=-1.5, frequency_penalty=0.5),
               GenerationConfig(max_new_tokens=10, logit_bias={7: 100}),
               GenerationConfig(max_new_tokens=10, do_sample=True, seed=2, presence_penalty=1.0,
                                logit_bias={3: -100, 9: 4.5})]
    engine = GenerationEngine(KVCacheStepper(tiny), mix_lengths=True)
    got = served(engine, [GenerationRequest(p, c) for p, c in zip(given, configs, strict=True)])
    assert got[3] == [7] * 10
    for prompt, config, tokens in zip(given, configs, got, strict=True):
        assert tokens == generate(KVCacheStepper(tiny), [prompt.tolist()], config=config).tokens[0].tolist()
    assert len({tuple(t) for t in got}) == len(got)  # the settings did differ per row


def test_a_logit_bias_past_the_vocabulary_is_refused_at_submit(tiny):
    engine = GenerationEngine(KVCacheStepper(tiny))
    request = GenerationRequest(np.array([1, 2]), GenerationConfig(max_new_tokens=2, logit_bias={VOCAB: 1.0}))
    with pytest.raises(InputError, match=f"logit_bias names token id {VOCAB}, past the model's vocabulary"):
        engine.submit(request, lambda event: None)


def test_a_bias_the_open_vocabulary_cannot_take_fails_its_row_only(tiny, monkeypatch):
    """A file that leaves its vocabulary open cannot check logit_bias at submit: the row fails at its first token,
    saying why, and the rows beside it run on."""
    stepper = KVCacheStepper(tiny)
    monkeypatch.setattr(stepper.graph, "vocab_size", None)
    engine = GenerationEngine(stepper, mix_lengths=True)
    events, done = [], threading.Event()

    def notify(event):
        events.append(event)
        done.set()

    good = GenerationRequest(np.array([4, 5, 6]), GenerationConfig(max_new_tokens=8))
    engine.start()
    try:
        engine.submit(GenerationRequest(np.array([1, 2]), GenerationConfig(max_new_tokens=8, logit_bias={VOCAB: 1})),
                      notify)
        assert run_all(engine, [good]) == [alone(tiny, [4, 5, 6], max_new_tokens=8)]
        assert done.wait(10)
    finally:
        engine.stop(10)
    assert len(events) == 1 and events[0].finish_reason == "error" and "past the model's vocabulary" in events[0].error


def test_logprobs_are_the_models_raw_distribution(tiny):
    engine = GenerationEngine(KVCacheStepper(tiny))
    engine.start()
    try:
        events = events_of(engine, GenerationRequest(np.array([4, 5, 6]), GenerationConfig(max_new_tokens=2),
                                                     logprobs=3))
    finally:
        engine.stop(10)
    stepper = KVCacheStepper(tiny)
    logits = stepper.prefill(np.array([[4, 5, 6]]), np.ones((1, 3), np.int64))[0]
    expected = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    first = events[0]
    assert first.token == int(np.argmax(logits))
    assert first.logprob == pytest.approx(float(expected[first.token]), abs=1e-5)
    assert list(first.top_logprobs) == np.argsort(-expected)[:3].tolist()



def torch_log_probs(prompt: list[int]) -> np.ndarray:
    """log-softmax of TinyLM's own logits at every position of ``prompt`` [seq, vocab]: the torch module the file
    was exported from (``build`` is seeded), run whole, no cache."""
    import torch

    from tests.conftest import user_module

    module = user_module("causal_lm").build().eval()
    with torch.no_grad():
        logits = module(torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.bool))[0].double().numpy()
    return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)


@pytest.mark.parametrize("model", ["tiny_scored", "tiny_holes_scored"])
def test_prompt_logprobs_score_every_prompt_token_across_prefill_chunks(model, request):
    path = request.getfixturevalue(model)  # both cache layouts: the ragged and the holes stepper's calls
    prompt = [4, 9, 2, 33, 17, 8, 41, 5]
    engine = GenerationEngine(KVCacheStepper(path), prefill_chunk=3)  # chunks of 3, 3, 2: scores cross them
    engine.start()
    try:
        events = events_of(engine, GenerationRequest(np.array(prompt), GenerationConfig(max_new_tokens=2),
                                                     logprobs=4, prompt_logprobs=True))
        with pytest.raises(InputError, match="prompt_logprobs needs logprobs"):
            engine.submit(GenerationRequest(np.array(prompt), GenerationConfig(max_new_tokens=2),
                                            prompt_logprobs=True), lambda event: None)
    finally:
        engine.stop(10)
    expected = torch_log_probs(prompt)
    scored = events[0].prompt_logprobs
    assert events[1].prompt_logprobs is None  # told once, with the first token
    assert [s.token for s in scored] == prompt
    assert scored[0].logprob is None and scored[0].top_logprobs is None
    for i in range(1, len(prompt)):  # position i - 1's distribution scores token i; float32 ORT vs torch
        assert scored[i].logprob == pytest.approx(expected[i - 1, prompt[i]], abs=1e-4)
        assert list(scored[i].top_logprobs) == np.argsort(-expected[i - 1], kind="stable")[:4].tolist()
        assert list(scored[i].top_logprobs.values()) == pytest.approx(np.sort(expected[i - 1])[::-1][:4], abs=1e-4)
    assert events[0].logprob == pytest.approx(expected[-1, events[0].token], abs=1e-4)


@pytest.mark.parametrize("model", ["tiny", "tiny_holes", "ragged"])
def test_cancelled_requests_free_their_rows_and_the_others_finish(model, request):
    tiny = request.getfixturevalue(model)  # TinyLM in either layout, or the tutorial GPT's ragged cache
    engine = GenerationEngine(KVCacheStepper(tiny), mix_lengths=True)
    given = prompts(6, seed=2)
    seen = [[] for _ in given]
    done = [threading.Event() for _ in given]
    tickets = []
    cancelled = threading.Event()

    def listener(i):
        def notify(event):
            seen[i].append(event.token)
            if i % 2 and len(seen[i]) == 2:
                tickets[i].cancel()
                cancelled.set()
            if event.finish_reason:
                done[i].set()
        return notify

    for i, prompt in enumerate(given):
        tickets.append(engine.submit(GenerationRequest(prompt, GenerationConfig(max_new_tokens=40)), listener(i)))
    engine.start()
    try:
        for i in range(0, len(given), 2):
            assert done[i].wait(30)
    finally:
        engine.stop(10)
    for i, prompt in enumerate(given):
        if i % 2:
            assert not done[i].is_set() and 2 <= len(seen[i]) < 40
        else:
            assert seen[i] == alone(tiny, prompt.tolist(), max_new_tokens=40)
    assert engine.snapshot()["cache_positions"] == 0


def test_the_budget_queues_what_does_not_fit_and_refuses_what_never_fits(tiny):
    assert KVBudget(100, mixed=True).planned([10, 30]) == 60
    assert KVBudget(100, mixed=False).planned([10, 30]) == 40
    assert not KVBudget(100, mixed=True).fits([40, 10], 30)
    engine = GenerationEngine(KVCacheStepper(tiny), max_kv_tokens=40, max_waiting=2, mix_lengths=True)
    with pytest.raises(RequestTooLarge, match="--max-kv-tokens 40"):
        engine.submit(GenerationRequest(np.arange(1, 31), GenerationConfig(max_new_tokens=11)), print)
    with pytest.raises(Exception, match="past the model's vocabulary"):
        engine.submit(GenerationRequest(np.array([VOCAB]), GenerationConfig()), print)
    request = GenerationRequest(np.arange(1, 11), GenerationConfig(max_new_tokens=10))  # needs 20: two fit
    engine.submit(request, lambda e: None)
    engine.submit(request, lambda e: None)
    with pytest.raises(EngineBusy, match="2 requests already wait"):
        engine.submit(request, lambda e: None)
    # four at once where two fit: two wait their turn, and all finish
    running = GenerationEngine(KVCacheStepper(tiny), max_kv_tokens=40, max_waiting=8, mix_lengths=True)
    running.start()
    try:
        results = run_all(running, [request] * 4)
    finally:
        running.stop(10)
    assert all(r == results[0] for r in results)


def test_a_model_with_its_own_positions_batches_only_aligned_rows_and_each_equals_alone(lm_cache):
    """GPT-2's export counts positions over the cache width and takes no position_ids: holes would shift a row's
    positions, so the engine keeps rows of one length together (and says so)."""
    pytest.importorskip("transformers")
    path = lm_cache("hf_gpt2", *HOLES_LM)[0]
    engine = GenerationEngine(KVCacheStepper(path), prefill_chunk=16)
    assert not engine.mix_lengths and "exact length" in engine.batching
    rng = np.random.default_rng(5)
    given = [rng.integers(0, 96, n) for n in (4, 9, 4, 12, 9, 4, 30)]  # equal lengths share a cohort
    got = served(engine, [GenerationRequest(p, GenerationConfig(max_new_tokens=5 + i % 3))
                           for i, p in enumerate(given)])
    for i, (prompt, tokens) in enumerate(zip(given, got, strict=True)):
        # no eos, as the requests ask: the file records its config's (0, a token this GPT-2 draws often)
        assert tokens == alone(path, prompt.tolist(), max_new_tokens=5 + i % 3, eos_token_id=[])


def test_a_rotary_decoders_requests_of_any_length_share_the_loop_each_equal_to_transformers_alone(lm_cache):
    """The tiny Llama's `--kv-cache` export with the defaults takes position_ids and is ragged (GroupQueryAttention
    over its 2 KV heads' cache): requests of different lengths share one cohort (each row at its own length, a long
    prompt prefilled in chunks), and each gets transformers' greedy generate on its prompt alone."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.conftest import user_module

    llama = user_module("hf_llama")
    path = lm_cache("hf_llama")[0]
    engine = GenerationEngine(KVCacheStepper(path), prefill_chunk=7)
    assert engine.mix_lengths and "continuous batching over a ragged cache" in engine.batching
    rng = np.random.default_rng(37)
    given = [rng.integers(3, llama.VOCAB, n) for n in (4, 9, 2, 12, 6, 1)]
    config = GenerationConfig(max_new_tokens=10, eos_token_id=llama.EOS_ID)
    got = served(engine, [GenerationRequest(p, config) for p in given])
    model = llama.build()
    for prompt, tokens in zip(given, got, strict=True):
        with torch.no_grad():
            alone = model.generate(input_ids=torch.from_numpy(prompt)[None], do_sample=False, max_new_tokens=10,
                                   eos_token_id=llama.EOS_ID, pad_token_id=llama.EOS_ID)[0, len(prompt):]
        assert tokens == alone.tolist(), f"prompt of {len(prompt)}"


def test_a_failing_model_call_fails_its_requests_and_the_engine_serves_the_next(tiny, monkeypatch):
    stepper = KVCacheStepper(tiny)
    engine = GenerationEngine(stepper, mix_lengths=True)
    calls = {"n": 0}

    def flaky(call):
        def run(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:  # the first decode step
                raise RuntimeError("device lost")
            return call(*args, **kwargs)
        return run

    # a holes file's calls go through run, a ragged file's through run_in_place
    monkeypatch.setattr(stepper.graph, "run", flaky(stepper.graph.run))
    monkeypatch.setattr(stepper.graph, "run_in_place", flaky(stepper.graph.run_in_place))
    engine.start()
    try:
        events = events_of(engine, GenerationRequest(np.array([1, 2, 3]), GenerationConfig(max_new_tokens=4)))
        assert events[-1].finish_reason == "error" and "device lost" in events[-1].error
        assert run_all(engine, [GenerationRequest(np.array([1, 2, 3]), GenerationConfig(max_new_tokens=4))]) == [
            alone(tiny, [1, 2, 3], max_new_tokens=4)]
    finally:
        engine.stop(10)


def test_an_encoder_decoder_joins_rows_of_other_sources_each_equal_to_alone(seq2seq):
    decoder, encoder, start, vocab = seq2seq

    def stepper():
        return KVCacheStepper(decoder, encoder=encoder, decoder_start_token_id=start)

    engine = GenerationEngine(stepper())
    assert not engine.mix_lengths  # no attention_mask for the decoder's own holes: rows join when aligned
    rng = np.random.default_rng(6)
    given = [rng.integers(1, vocab, n) for n in (3, 9, 1, 6, 9)]  # sources of other lengths share a cohort (masked)
    got = served(engine, [GenerationRequest(p, GenerationConfig(max_new_tokens=4 + i % 3))
                           for i, p in enumerate(given)])
    for i, (source, tokens) in enumerate(zip(given, got, strict=True)):
        assert tokens == generate(stepper(), [source.tolist()], max_new_tokens=4 + i % 3).tokens[0].tolist()
    with pytest.raises(Exception, match="vocabulary"):
        GenerationEngine(stepper()).submit(GenerationRequest(np.array([vocab + 5]), GenerationConfig()), print)


# --- a ragged file (export with position_ids): one cohort, rows at their own lengths, joins into spare rows ---


@pytest.fixture(scope="module")
def ragged(ragged_lm):
    return ragged_lm("tutorial_gpt")  # learned positions: a row's must be its own


def test_ragged_requests_of_mixed_lengths_each_equal_alone_and_free_their_cache(ragged):
    stepper = KVCacheStepper(ragged)
    engine = GenerationEngine(stepper, max_kv_tokens=4096, max_running=8, prefill_chunk=7)
    assert stepper.ragged and engine.mix_lengths and "ragged cache" in engine.batching
    rng = np.random.default_rng(4)
    given = [rng.integers(0, 60, n) for n in (3, 11, 1, 7, 15, 4)]
    configs = [GenerationConfig(max_new_tokens=4 + 3 * (i % 3), eos_token_id=[]) for i in range(len(given))]
    got = served(engine, [GenerationRequest(p, c) for p, c in zip(given, configs, strict=True)])
    for prompt, config, tokens in zip(given, configs, got, strict=True):
        assert tokens == alone(ragged, prompt.tolist(), config=config)
    assert engine.snapshot() == {"running": 0, "waiting": 0, "cache_positions": 0}


def test_a_ragged_cohort_joins_and_leaves_without_moving_its_running_rows(ragged):
    """Driven turn by turn (no thread): the cohort's buffers are planned from the requests' needs, a join fills a
    spare row and a departure moves only the last row into the leaving row's place."""
    engine = GenerationEngine(KVCacheStepper(ragged), max_kv_tokens=4096, max_running=4)
    rng = np.random.default_rng(6)
    requests = [GenerationRequest(rng.integers(0, 60, n), GenerationConfig(max_new_tokens=m, eos_token_id=[]))
                for n, m in ((5, 12), (9, 3), (2, 12))]
    seen = [[] for _ in requests]
    for i, request in enumerate(requests):
        engine.submit(request, lambda event, i=i: seen[i].append(event.token))
    engine._admit()
    engine._turn()  # prefills all three (within prefill_chunk) and joins them into one cohort
    (cohort,) = engine._cohorts
    stepper = cohort.stepper
    assert stepper.capacity == max(r.kv_need for r in requests) and stepper.row_capacity >= 3
    assert stepper.cache_positions == stepper.row_capacity * stepper.capacity
    buffers = {name: buffer for name, buffer in stepper.buffers.items()}
    first = next(iter(buffers))
    while len(cohort.sequences) == 3:
        before = buffers[first].copy()
        engine._turn()
    # request 1 (the shortest run) left from the middle: the last row took its place, row 0 was not moved
    assert [s.id for s in cohort.sequences] == [0, 2]
    assert all(stepper.buffers[name] is buffer for name, buffer in buffers.items())
    width = int(stepper.lengths[0]) - 1
    np.testing.assert_array_equal(buffers[first][0, :, :width], before[0, :, :width])
    while engine._cohorts:
        engine._turn()
    for request, tokens in zip(requests, seen, strict=True):
        assert tokens == alone(ragged, request.prompt.tolist(), config=request.config)


@pytest.mark.parametrize("mix", [False, True])
def test_requests_arriving_at_other_turns_step_prepared_and_each_equal_alone_on_the_general_step(ragged, monkeypatch,
                                                                                                 mix):
    """Driven turn by turn as the engine's loop does (one denormal scope a turn), requests of other lengths and
    settings arriving at other turns: without mixing lengths they run in several cohorts, forks stepping in turn
    through this thread's one binding (each cohort's prepared step must decline after another's call), merging when
    aligned; mixed, they join and leave one cohort. Each request's tokens are exactly its prompt's alone on the
    general step (``_DecodeStep.ready`` False), and some steps ran prepared (unmixed: the last request's, running
    alone at the end; while two cohorts step in one turn, each one's call unbinds the other's, and none does)."""
    from mha_deploy.runtime.generation import flushing_scope
    from mha_deploy.runtime.kv_stepper import _DecodeStep

    rng = np.random.default_rng(9)
    arrivals = {0: [(4, 9), (4, 6)], 1: [(11, 8)], 3: [(2, 10), (7, 5)], 4: [(3, 7)], 7: [(13, 16), (1, 4)]}
    requests = {turn: [GenerationRequest(rng.integers(0, 60, n), GenerationConfig(
        max_new_tokens=m, eos_token_id=[], **({"do_sample": True, "seed": n} if n % 2 else {})))
        for n, m in given] for turn, given in arrivals.items()}
    engine = GenerationEngine(KVCacheStepper(ragged), max_kv_tokens=4096, max_running=8, mix_lengths=mix)
    prepared, real = [], _DecodeStep.__call__
    monkeypatch.setattr(_DecodeStep, "__call__", lambda self, ids: prepared.append(1) or real(self, ids))
    seen, cohorts, submitted = [], [], []
    for turn in range(60):
        for request in requests.get(turn, []):
            seen.append([])
            submitted.append(request)
            engine.submit(request, lambda event, into=seen[-1]: into.append(event.token))
        engine._drop_cancelled()
        engine._admit()
        if not engine._prefilling and not engine._cohorts and turn > max(arrivals):
            break
        with flushing_scope(engine.stepper):
            engine._turn()
        cohorts.append(len(engine._cohorts))
    assert prepared and len(submitted) == 8
    assert max(cohorts) == 1 if mix else max(cohorts) >= 3
    monkeypatch.undo()
    monkeypatch.setattr(_DecodeStep, "ready", lambda self, next_ids: False)
    for request, tokens in zip(submitted, seen, strict=True):
        assert tokens == alone(ragged, request.prompt.tolist(), config=request.config)
