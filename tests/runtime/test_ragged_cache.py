"""KVCacheStepper over a ragged KV-cache file (GroupQueryAttention, each row at its own length, one buffer per cache
input read as past and written as present): the searches equal a torch loop over the module, the cache is sized once
and never copied step to step, and rows leave, repeat and join without moving the running ones."""

from __future__ import annotations

import numpy as np
import pytest

from mha_deploy.errors import InputError
from mha_deploy.metadata import CACHE_RAGGED
from mha_deploy.runtime.generation import generate
from mha_deploy.runtime.kv_stepper import KVCacheStepper
from tests.conftest import user_module
from tests.runtime.test_generation import ORT_SEARCHES, RecomputeStepper

torch = pytest.importorskip("torch")

MAX_NEW = 10
LENGTHS = [5, 2, 9, 3]  # mixed: the shorter rows are padded in the prompt batch


def torch_logits(name: str):
    model = user_module(name).build().eval()
    return lambda ids, mask, positions: model(ids, mask.bool() if name == "causal_lm" else mask)


def mixed_prompts(vocab: int, seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, n).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def tiny(ragged_lm):
    """TinyLM (no positions): a left-padded batch through the torch module is exact, so whole batches compare."""
    return ragged_lm("causal_lm")


@pytest.fixture(scope="module")
def gpt(ragged_lm):
    """The tutorial GPT (learned absolute positions): a row's positions must be its own, whatever the batch."""
    return ragged_lm("tutorial_gpt")


def test_the_export_is_ragged_and_the_stepper_reads_it(tiny):
    stepper = KVCacheStepper(tiny)
    assert stepper.cache_layout == CACHE_RAGGED and stepper.ragged


@pytest.mark.parametrize("search", ORT_SEARCHES)
def test_a_mixed_batch_equals_the_torch_loop(tiny, search):
    """TinyLM through the torch module, a left-padded batch recomputed each step, against the ragged file."""
    prompts = mixed_prompts(50)
    options = {"max_new_tokens": MAX_NEW, "eos_token_id": [], **ORT_SEARCHES[search]}
    expected = generate(RecomputeStepper(torch_logits("causal_lm")), prompts, **options)
    got = generate(KVCacheStepper(tiny), prompts, **options)
    assert [t.tolist() for t in got.tokens] == [t.tolist() for t in expected.tokens]


@pytest.mark.parametrize("search", ["greedy", "beams"])
def test_each_row_keeps_its_own_positions(gpt, search):
    """The tutorial GPT's positions count from each row's first token: every prompt of a mixed batch gets the tokens
    the torch module gives it alone (no padding there)."""
    prompts = mixed_prompts(60)
    options = {"max_new_tokens": MAX_NEW, "eos_token_id": [], **ORT_SEARCHES[search]}
    got = generate(KVCacheStepper(gpt), prompts, **options)
    for prompt, tokens in zip(prompts, got.tokens, strict=True):
        alone = generate(RecomputeStepper(torch_logits("tutorial_gpt")), [prompt], **options)
        assert tokens.tolist() == alone.tokens[0].tolist()


def test_sampling_with_a_seed_is_reproducible(gpt):
    prompts = mixed_prompts(60)
    options = {"max_new_tokens": MAX_NEW, **ORT_SEARCHES["sampled"]}
    stepper = KVCacheStepper(gpt)
    first = generate(stepper, prompts, **options)
    again = generate(stepper, prompts, **options)  # the same stepper: its reused buffers change nothing
    assert [t.tolist() for t in first.tokens] == [t.tolist() for t in again.tokens]


def start(path, prompts: list[list[int]], reserve: tuple[int, int] | None = None) -> tuple[KVCacheStepper, np.ndarray]:
    stepper = KVCacheStepper(path)
    if reserve is not None:
        stepper.reserve(*reserve)
    width = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width), np.int64)
    mask = np.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)], mask[row, : len(prompt)] = prompt, 1  # right-padded: the stepper's own layout
    return stepper, stepper.prefill(ids, mask)


def alone_logits(path, prompt: list[int], steps: list[int]) -> np.ndarray:
    stepper, logits = start(path, [prompt])
    for token in steps:
        logits = stepper.step(np.array([token]))
    return logits[0]


def test_reserve_sizes_the_cache_once_and_steps_write_into_it(gpt):
    prompts = mixed_prompts(60)
    stepper, _ = start(gpt, prompts, reserve=(9 + 6, 4))
    assert (stepper.capacity, stepper.row_capacity) == (15, 4)
    buffers = {name: (buffer, buffer.ctypes.data) for name, buffer in stepper.buffers.items()}
    for _ in range(6):
        stepper.step(np.ones(4, np.int64))
    assert stepper.lengths.tolist() == [n + 6 for n in LENGTHS]
    for name, (buffer, address) in buffers.items():
        assert stepper.buffers[name] is buffer and buffer.ctypes.data == address  # written in place, never moved
    assert stepper.cache_positions == 4 * 15


def test_without_reserve_the_cache_doubles_and_continues_exactly(gpt):
    prompt = mixed_prompts(60)[2]
    stepper, _ = start(gpt, [prompt])
    assert stepper.capacity == len(prompt)
    capacities = []
    for _ in range(len(prompt) + 1):
        logits = stepper.step(np.array([7]))
        capacities.append(stepper.capacity)
    assert sorted(set(capacities)) == [2 * len(prompt), 4 * len(prompt)]  # grown twice: copied twice in all
    np.testing.assert_allclose(logits[0], alone_logits(gpt, prompt + [7] * len(prompt), [7]), atol=1e-5, rtol=1e-5)


def test_keep_moves_only_the_rows_that_change_place(gpt):
    """A swap-remove (row 1 leaves, the last takes its place) writes one row; the others stay where they are."""
    prompts = mixed_prompts(60)
    stepper, _ = start(gpt, prompts, reserve=(16, 4))
    stepper.step(np.array([4, 5, 6, 7]))
    name = next(iter(stepper.buffers))
    buffer = stepper.buffers[name]
    before = buffer.copy()
    stepper.keep(np.array([0, 3, 2]))
    assert stepper.buffers[name] is buffer and stepper.lengths.tolist() == [6, 4, 10]
    np.testing.assert_array_equal(buffer[[0, 2]], before[[0, 2]])  # untouched
    np.testing.assert_array_equal(buffer[1, :, :4], before[3, :, :4])  # the moved row, its positions in use
    logits = stepper.step(np.array([1, 2, 3]))
    for row, (prompt, token) in enumerate([(0, 4), (3, 7), (2, 6)]):
        expected = alone_logits(gpt, prompts[prompt], [token, [1, 2, 3][row]])
        np.testing.assert_allclose(logits[row], expected, atol=1e-5, rtol=1e-5)


def test_join_fills_spare_rows_without_moving_the_running_ones(gpt):
    prompts = mixed_prompts(60)
    running, _ = start(gpt, prompts[:2], reserve=(16, 4))
    running.step(np.array([4, 5]))
    buffers = {name: (buffer, buffer[:2].copy()) for name, buffer in running.buffers.items()}
    joining = running.fork()
    assert joining.rows == 0 and not joining.buffers  # its own cache, nothing shared
    joining.prefill(np.array([prompts[2]]), np.ones((1, len(prompts[2])), np.int64))
    running.join(joining)
    assert joining.rows == 0 and running.lengths.tolist() == [6, 3, 9]
    for name, (buffer, rows) in buffers.items():
        assert running.buffers[name] is buffer  # within its row capacity: no reallocation
        np.testing.assert_array_equal(buffer[:2], rows)  # the running rows not written
    logits = running.step(np.array([1, 2, 3]))
    for row, steps in enumerate([[4, 1], [5, 2], [3]]):
        np.testing.assert_allclose(logits[row], alone_logits(gpt, prompts[row], steps), atol=1e-5, rtol=1e-5)


def test_extend_runs_each_row_on_its_own_rows_of_the_cache(gpt):
    """ORT's GroupQueryAttention takes several tokens after a past for one row per call: extend of several rows
    runs them one by one, on views of the buffers, and equals each row's prefill of the whole."""
    prompts = mixed_prompts(60)[:2]
    stepper, _ = start(gpt, prompts, reserve=(16, 2))
    more = np.array([[3, 4, 5], [6, 7, 8]])
    logits = stepper.extend(more)
    for row, prompt in enumerate(prompts):
        _, expected = start(gpt, [prompt + more[row].tolist()])
        np.testing.assert_allclose(logits[row], expected[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(InputError, match="past the vocabulary"):
        stepper.extend(np.array([[60], [1]]))


# --- MHASession.run on a ragged file: the contract of exporters.fusion.ragged_cache, validated by its own rules ---


def module_alone(name: str, sequence: list[int]) -> np.ndarray:
    """The torch module's logits for ``sequence``'s last token, the row alone."""
    model = user_module(name).build().eval()
    with torch.no_grad():
        return model(torch.tensor([sequence]), torch.ones(1, len(sequence), dtype=torch.long))[0, -1].numpy()


def test_mha_session_runs_the_ragged_contract_and_equals_the_module(gpt):
    """A right-padded first call, then one token per row over a past wider than any row (W 6): each row's logits
    are the module's on that row alone, and present is max(total, W) wide."""
    from mha_deploy.runtime.session import MHASession

    session = MHASession(gpt, provider="cpu")
    assert session.metadata.cache_layout == CACHE_RAGGED
    caches = [n for n in session.input_names if n.startswith("past_key_values.")]
    heads, head_dim = session.signature.tensors[caches[0]].axes[1], session.signature.tensors[caches[0]].axes[3]
    prompts, nexts = [[7, 3, 9], [4]], [12, 30]
    first = session.run({
        "input_ids": np.array([[7, 3, 9], [4, 0, 0]]), "attention_mask": np.array([[1, 1, 1], [1, 0, 0]]),
        "position_ids": np.array([[0, 1, 2], [0, 1, 2]]),
        **{name: np.zeros((2, heads, 0, head_dim), np.float32) for name in caches}})
    assert first["logits"].shape[1] == 1  # the default file's logits: each row's last real token's only
    for row, prompt in enumerate(prompts):
        np.testing.assert_allclose(first["logits"][row, 0], module_alone("tutorial_gpt", prompt),
                                   atol=1e-4, rtol=1e-4, err_msg=f"first call, row {row}")
    # Each row's cache is its first n positions; a past wider than every row (W 6) is what a runtime's buffer is.
    past = {name: np.pad(first[name.replace("past_key_values", "present")], ((0, 0), (0, 0), (0, 3), (0, 0)))
            for name in caches}
    second = session.run({"input_ids": np.array([[nexts[0]], [nexts[1]]]),
                          "attention_mask": np.array([[1, 1, 1, 1], [1, 1, 0, 0]]),
                          "position_ids": np.array([[3], [1]]), **past})
    for row, (prompt, token) in enumerate(zip(prompts, nexts, strict=True)):
        np.testing.assert_allclose(second["logits"][row, 0], module_alone("tutorial_gpt", [*prompt, token]),
                                   atol=1e-4, rtol=1e-4, err_msg=f"second call, row {row}")
    assert all(second[name.replace("past_key_values", "present")].shape[2] == 6 for name in caches)


@pytest.mark.parametrize(("mask", "ids", "width", "message"), [
    ([[0, 1, 1], [1, 0, 0]], [[1, 2, 3], [4, 0, 0]], 0, "right padding only"),
    ([[1, 1, 1, 1], [1, 0, 0, 0]], [[1, 2], [3, 4]], 2, "only a first call"),
    ([[1, 1, 1, 1], [1, 1, 1, 1]], [[1, 2], [3, 4]], 2, "need batch 1"),
    ([[1, 1, 1, 1], [1, 1, 0, 0]], [[1], [2]], 2, r"past of 3 tokens .* more than the 2 positions"),
    ([[1, 1], [1, 1]], [[1, 2, 3], [4, 5, 6]], 0, "total >= seq"),
])
def test_mha_session_refuses_what_the_ragged_contract_does_not_allow(gpt, mask, ids, width, message):
    from mha_deploy.runtime.session import MHASession

    session = MHASession(gpt, provider="cpu")
    caches = [n for n in session.input_names if n.startswith("past_key_values.")]
    _, heads, _, head_dim = session.signature.tensors[caches[0]].axes
    ids = np.array(ids)
    feeds = {"input_ids": ids, "attention_mask": np.array(mask), "position_ids": np.zeros_like(ids),
             **{name: np.zeros((2, heads, width, head_dim), np.float32) for name in caches}}
    with pytest.raises(InputError, match=message):
        session.run(feeds)


# --- the host path of a decode step: nothing read back, one rebind, one denormal scope, one read of the file -------


def test_a_decode_step_reads_no_output_back_and_writes_its_logits_into_the_steppers_array(gpt, monkeypatch):
    """Steps write the logits into one array of the stepper's (no ``get_outputs``, the same array every step: the
    next call overwrites it, as ``step`` says); each step's logits, read before the next call, equal the prompt
    alone (atol 1e-5: a cache of another capacity), also when another stepper on this thread prefills between
    steps (ORT allocates its logits and binds its own mask and caches: the prepared step must not run on them)."""
    import onnxruntime as ort

    prompt, steps = mixed_prompts(60)[2], [7, 3, 11, 5, 2]
    stepper, _ = start(gpt, [prompt])
    reads = []
    real = ort.IOBinding.get_outputs
    monkeypatch.setattr(ort.IOBinding, "get_outputs", lambda self: reads.append(1) or real(self))
    returned, read = [], []
    for index, token in enumerate(steps):
        logits = stepper.step(np.array([token]))
        returned.append(logits)
        read.append(logits.copy())  # as the caller reads them, before the next call
        if index == 1:
            other = stepper.fork()
            other.prefill(np.array([prompt[:3]]), np.ones((1, 3), np.int64))  # ORT allocates its logits
    assert len(reads) == 1  # the fork's prefill only
    assert all(np.shares_memory(logits, returned[0]) for logits in returned)
    for index, logits in enumerate(read):
        np.testing.assert_allclose(logits[0], alone_logits(gpt, prompt, steps[: index + 1]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch", ["mixed", "one prompt"])
def test_decode_steps_after_the_first_run_prepared_and_equal_the_general_step(gpt, monkeypatch, batch):
    """Once a batch's rows and buffers stay put, its decode steps run prepared (kv_stepper._DecodeStep: the kept
    arrays written in place, only the mask bound anew; one row's mask a slice of a kept row of ones), not through the
    general call; the greedy tokens of a mixed batch and of one prompt are then exactly those of the general step
    everywhere."""
    from mha_deploy.runtime.kv_stepper import _DecodeStep

    prompts = mixed_prompts(60) if batch == "mixed" else mixed_prompts(60)[:1]
    stepper, calls = KVCacheStepper(gpt), []
    general_call = stepper.graph.run_in_place
    monkeypatch.setattr(stepper.graph, "run_in_place", lambda *a, **k: calls.append(1) or general_call(*a, **k))
    prepared = generate(stepper, prompts, max_new_tokens=MAX_NEW, eos_token_id=[])
    assert len(calls) == 2  # the prefill and the first step; the other MAX_NEW - 2 steps ran prepared
    monkeypatch.setattr(_DecodeStep, "ready", lambda self, next_ids: False)
    general = generate(KVCacheStepper(gpt), prompts, max_new_tokens=MAX_NEW, eos_token_id=[])
    assert [t.tolist() for t in prepared.tokens] == [t.tolist() for t in general.tokens]


def test_beam_search_steps_run_prepared_across_its_reordering_and_equal_the_general_step(gpt, monkeypatch):
    """Beam search reorders its rows every step (``keep`` with as many rows as before): the lengths are written in
    place and the prepared step stays, so its steps run prepared; its hypotheses and scores are those of the general
    step exactly."""
    from mha_deploy.runtime.kv_stepper import _DecodeStep

    prompts = mixed_prompts(60)[:2]
    calls = counting_prepared(monkeypatch)
    prepared = generate(KVCacheStepper(gpt), prompts, max_new_tokens=MAX_NEW, num_beams=3, eos_token_id=[])
    assert len(calls) >= MAX_NEW - 3  # every step after the first, but for where a reordering grew the buffers
    monkeypatch.setattr(_DecodeStep, "ready", lambda self, next_ids: False)
    general = generate(KVCacheStepper(gpt), prompts, max_new_tokens=MAX_NEW, num_beams=3, eos_token_id=[])
    assert [t.tolist() for t in prepared.tokens] == [t.tolist() for t in general.tokens]
    assert prepared.scores == general.scores


def test_generate_flushes_denormals_once_and_stream_once_a_call(gpt, monkeypatch):
    """generate enters one denormal scope for the whole generation (not one per model call) and leaves this
    thread's floating-point state as it was; stream, which returns to its caller between steps, keeps one per
    call; both give the same tokens."""
    from mha_deploy.runtime import session as session_module
    from mha_deploy.runtime.generation import stream

    stepper = KVCacheStepper(gpt)
    prompts = mixed_prompts(60)
    entered = []
    real = session_module.flushing_denormals

    def counting(enabled=True):
        entered.append(enabled)
        return real(enabled)

    monkeypatch.setattr(session_module, "flushing_denormals", counting)
    tokens = generate(stepper, prompts, max_new_tokens=6, eos_token_id=[]).tokens
    assert entered == [True]
    assert float(np.float32(1e-38) / np.float32(10)) != 0.0  # this thread keeps its denormals after it
    entered.clear()
    streamed = [[] for _ in prompts]
    for step in stream(stepper, prompts, max_new_tokens=6, eos_token_id=[]):
        for prompt, token in zip(step.prompts, step.tokens, strict=True):
            streamed[prompt].append(int(token))
    assert entered == [True] * 6  # the prefill and five steps
    assert streamed == [t.tolist() for t in tokens]


def test_a_decoders_file_is_read_once_on_opening(gpt, monkeypatch):
    """KVCacheStepper on a path reads the file's graph once (weights left in the file): its metadata, the session's
    load and check, the stepper's ports and layout all take the graph read then (MHASession.graph_proto)."""
    import onnx

    from mha_deploy.runtime import session_file

    reads = []
    real_bytes, real_load = session_file.graph_bytes, onnx.load
    monkeypatch.setattr(session_file, "graph_bytes", lambda path: reads.append(path) or real_bytes(path))
    monkeypatch.setattr(onnx, "load", lambda *args, **kwargs: reads.append(args) or real_load(*args, **kwargs))
    stepper = KVCacheStepper(gpt)
    assert len(reads) == 1
    assert stepper.graph.session.graph_proto is not None and stepper.cache_layout == CACHE_RAGGED
    assert set(stepper.graph.inputs) == {i.name for i in stepper.graph.session.graph_proto.graph.input}


# --- the prepared decode step (kv_stepper._DecodeStep) where its rows, buffers, binding or thread move between steps:
# each run against the general step (``_DecodeStep.ready`` False) or each row's prompt alone ---


def general_only(monkeypatch) -> None:
    from mha_deploy.runtime.kv_stepper import _DecodeStep

    monkeypatch.setattr(_DecodeStep, "ready", lambda self, next_ids: False)


def counting_prepared(monkeypatch) -> list:
    """A list that grows by one per prepared step run (so that a test knows the path it checks was taken)."""
    from mha_deploy.runtime.kv_stepper import _DecodeStep

    calls, real = [], _DecodeStep.__call__
    monkeypatch.setattr(_DecodeStep, "__call__", lambda self, next_ids: calls.append(1) or real(self, next_ids))
    return calls


def prefill_rows(stepper: KVCacheStepper, prompts: list[list[int]]) -> np.ndarray:
    width = max(len(p) for p in prompts)
    ids, mask = np.zeros((len(prompts), width), np.int64), np.zeros((len(prompts), width), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)], mask[row, : len(prompt)] = prompt, 1
    return stepper.prefill(ids, mask)


def next_tokens(histories: list[list[int]]) -> np.ndarray:
    """A token per row decided by its own history, so that a row alone is fed exactly what it was fed in a batch."""
    return np.array([(7 * sum(h) + len(h)) % 59 + 1 for h in histories], np.int64)


def alone_by_prefix(path, histories: list[tuple[int, list[int]]]) -> dict[tuple, np.ndarray]:
    """Each (prompt length, history) run alone (on the general step where the caller says so): its logits after every
    token it was fed, by the history up to that token."""
    found = {}
    for length, history in histories:
        stepper, _ = start(path, [history[:length]])
        for end in range(length + 1, len(history) + 1):
            key = tuple(history[:end])
            logits = stepper.step(np.array(history[end - 1 : end]))[0]
            found.setdefault(key, logits.copy())
    return found


SCHEDULES = {  # which stepper (or thread) takes each step: runs of one and of several, so that some run prepared
    "fork": [0, 1, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1],
    "session": [0, 1, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1],
    "thread": [0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 0, 0],
}


@pytest.mark.parametrize("sharing", list(SCHEDULES))
def test_prepared_steps_of_steppers_sharing_a_session_or_moving_thread_each_equal_the_general_step(
        gpt, monkeypatch, sharing):
    """Two steppers stepping alternately on one thread (a fork, which shares the graph and this thread's binding; or
    a second KVCacheStepper on the same MHASession, with its own), or one stepper handed between two threads (its
    prepared step bound on the other thread's binding must decline): every step's logits, read before the next call,
    equal the general step's over the same rows alone (atol 1e-6: the same rows and capacities, only the path
    differs), and some steps did run prepared. The cache grows mid-run (no reserve), on either thread."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = mixed_prompts(60)
    groups = [prompts] if sharing == "thread" else [prompts[:2], prompts[2:]]

    def steppers() -> list[KVCacheStepper]:
        first = KVCacheStepper(gpt)
        made = [first] if sharing == "thread" else [first, first.fork() if sharing == "fork"
                                                    else KVCacheStepper(first.graph.session)]
        for stepper, group in zip(made, groups, strict=True):
            prefill_rows(stepper, group)
        return made

    def step(stepper: KVCacheStepper, history: list[list[int]]) -> np.ndarray:
        with stepper.flushing():  # on the thread that steps: the scope the prepared step needs
            tokens = next_tokens(history)
            logits = stepper.step(tokens).copy()  # read before the next call, as the step says
        for row, token in zip(history, tokens.tolist(), strict=True):
            row.append(token)
        return logits

    def run(schedule: list[int]) -> list[list[np.ndarray]]:
        made = steppers()
        histories = [[list(p) for p in group] for group in groups]
        got = [[] for _ in made]
        with ThreadPoolExecutor(1) as other:
            for index, who in enumerate(schedule):
                count = len(prepared)
                if sharing == "thread":
                    got[0].append(step(made[0], histories[0]) if who == 0
                                  else other.submit(step, made[0], histories[0]).result())
                    if index and who != schedule[index - 1]:  # handed over: prepared on the other thread's binding
                        assert len(prepared) == count, f"step {index} ran prepared on another thread's binding"
                else:
                    got[who].append(step(made[who], histories[who]))
        capacities.append([s.capacity for s in made])
        return got

    capacities = []
    prepared = counting_prepared(monkeypatch)
    got = run(SCHEDULES[sharing])
    assert prepared
    with monkeypatch.context() as patched:
        general_only(patched)
        # each stepper alone on this thread, as many steps as it took
        schedule = [0] * len(SCHEDULES[sharing]) if sharing == "thread" else SCHEDULES[sharing]
        expected = [run([who] * schedule.count(who)) for who in range(len(groups))]
    assert max(capacities[0]) > max(len(p) for p in prompts) * 2  # grown twice: the prepared step met its room
    for who in range(len(groups)):
        assert len(got[who]) == len(expected[who][who])
        for index, (logits, alone) in enumerate(zip(got[who], expected[who][who], strict=True)):
            np.testing.assert_allclose(logits, alone, atol=1e-6, rtol=0, err_msg=f"stepper {who}, step {index}")


def fork_rows(stepper: KVCacheStepper, prompts: list[list[int]]) -> KVCacheStepper:
    other = stepper.fork()
    prefill_rows(other, prompts)
    return other


CHANGES = {  # what the stepper is told between steps 4 and 5, then 8 and 9 (of 12)
    "finish": [("keep", [0, 2, 3]), ("keep", [1, 0])],  # a middle row leaves, then the last, the others swap
    "beams": [("keep", [2, 2, 0, 3, 3]), ("keep", [1, 0, 4, 2, 3])],  # more rows than the buffers hold, reordered
    "join": [("join", [[4, 9, 16, 25, 36, 49], [8]]), ("join", [[3]])],  # a fork's prefilled rows
    "reserve": [("reserve", (40, 6)), ("reserve", (64,))],
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_prepared_steps_around_keep_join_reserve_and_growth_equal_each_row_alone(gpt, monkeypatch, change):
    """A mixed batch stepped prepared (no reserve: the cache doubles twice, so the prepared step reaches its room and
    declines for the general one to grow), with rows finishing from the middle, beams repeating and reordering rows
    (more rows than the buffers hold), a fork's rows joining, or reserve resizing, between steps: every row's logits
    at every step, read before the next call, equal its prompt alone (atol 1e-5: a cache of another capacity)."""
    prompts = mixed_prompts(60)
    stepper, _ = start(gpt, prompts)
    rows = [(len(p), list(p)) for p in prompts]  # per running row: its prompt length and history
    seen, capacities = [], {stepper.capacity}
    prepared = counting_prepared(monkeypatch)
    with stepper.flushing():
        for index in range(12):
            if index in (4, 8):
                kind, value = CHANGES[change][index // 8]
                if kind == "keep":
                    stepper.keep(np.array(value))
                    rows = [(n, list(h)) for n, h in (rows[i] for i in value)]
                elif kind == "join":
                    stepper.join(fork_rows(stepper, value))
                    rows += [(len(p), list(p)) for p in value]
                else:
                    stepper.reserve(*value)
                assert stepper.rows == len(rows)
            tokens = next_tokens([h for _, h in rows])
            logits = stepper.step(tokens)
            for (length, history), token, row in zip(rows, tokens.tolist(), logits, strict=True):
                history.append(token)
                seen.append((length, tuple(history), row.copy()))
            capacities.add(stepper.capacity)
    assert len(prepared) >= 6 and len(capacities) >= 3
    monkeypatch.undo()
    general_only(monkeypatch)
    histories = {(length, history) for length, history, _ in seen}
    leaves = [(n, list(h)) for n, h in histories if not any(len(o) > len(h) and o[: len(h)] == h for _, o in histories)]
    alone = alone_by_prefix(gpt, leaves)
    for _, history, logits in seen:
        np.testing.assert_allclose(logits, alone[history], atol=1e-5, rtol=1e-5, err_msg=f"history {history}")


@pytest.mark.parametrize("search", ["greedy", "beams", "sampled"])
def test_generate_and_stream_on_the_prepared_step_equal_the_general_step_with_rows_finishing(gpt, monkeypatch, search):
    """generate (and stream, inside the stepper's denormal scope so that it too runs prepared) with eos ids that end
    some rows of a mixed batch early (the search keeps the others; beams reorder theirs every step, which sends each
    step to the general path): exactly the general step's tokens, and the beams' scores (atol 1e-5); stream's steps
    are generate's tokens."""
    from mha_deploy.runtime.generation import stream

    prompts = mixed_prompts(60)
    options = {"max_new_tokens": MAX_NEW, **ORT_SEARCHES[search]}
    with monkeypatch.context() as patched:
        general_only(patched)
        free = generate(KVCacheStepper(gpt), prompts, eos_token_id=[], **options).tokens
        # ids that rows 1 and 3 meet in the middle of their run: they (and any row meeting them) stop early
        eos = sorted({int(free[1][2]), int(free[3][4])})
        general = generate(KVCacheStepper(gpt), prompts, eos_token_id=eos, **options)
    prepared = counting_prepared(monkeypatch)
    stepper = KVCacheStepper(gpt)
    got = generate(stepper, prompts, eos_token_id=eos, **options)
    assert prepared or search == "beams"  # beams are kept (reordered) every step: each step is a general one
    assert [t.tolist() for t in got.tokens] == [t.tolist() for t in general.tokens]
    if search != "beams":
        assert len({len(t) for t in got.tokens}) > 1 and max(len(t) for t in got.tokens) == MAX_NEW  # some end early
    else:
        np.testing.assert_allclose(got.scores, general.scores, atol=1e-5, rtol=1e-5)
        return
    prepared.clear()
    streamed = [[] for _ in prompts]
    with stepper.flushing():
        for step in stream(stepper, prompts, eos_token_id=eos, **options):
            for prompt, token in zip(step.prompts.tolist(), step.tokens.tolist(), strict=True):
                streamed[prompt].append(token)
    assert prepared and streamed == [t.tolist() for t in got.tokens]


def test_a_failed_or_scalar_prepared_step_leaves_the_stepper_as_the_general_step_does(gpt, monkeypatch):
    """A prepared step whose call fails (a token id past the vocabulary: ORT's Gather refuses it) leaves the rows as
    they were, as the general step does, so that the next step continues them; one row's token may be given as a
    scalar as the general step takes it. Every step's logits equal the general step's (atol 1e-6: same rows and
    capacity, only the path differs)."""
    prompt = mixed_prompts(60)[2]

    def run() -> tuple[list[np.ndarray], list[int]]:
        stepper, _ = start(gpt, [prompt])
        got = []
        with stepper.flushing():
            for index, token in enumerate([7, 3, 11, 5, 2, np.int64(4), 9]):
                if index == 3:
                    with pytest.raises(Exception, match=r"out of data bounds|indices"):
                        stepper.step(np.array([10**6]))
                got.append(stepper.step(token if index == 5 else np.array([token])).copy())
        return got, stepper.lengths.tolist()

    prepared = counting_prepared(monkeypatch)
    got, lengths = run()
    assert len(prepared) >= 4
    monkeypatch.undo()
    general_only(monkeypatch)
    expected, expected_lengths = run()
    assert lengths == expected_lengths == [len(prompt) + 7]
    for index, (logits, alone) in enumerate(zip(got, expected, strict=True)):
        np.testing.assert_allclose(logits, alone, atol=1e-6, rtol=0, err_msg=f"step {index}")
