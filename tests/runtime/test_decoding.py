"""IncrementalDecoder: prefill + one-token steps + a multi-token step equal one causal forward of the whole sequence
in torch."""

from __future__ import annotations

import numpy as np
import pytest

from mha_deploy.compare import compare_outputs
from mha_deploy.errors import InputError, OptionError
from mha_deploy.exporters.graphs import attention_graph
from mha_deploy.exporters.parity import CacheCase, full_sequence_inputs, torch_reference
from mha_deploy.inputs import real_query_rows
from mha_deploy.metadata import Signature
from mha_deploy.runtime import MHASession
from tests.conftest import KV_DECODER, TEST_D_MODEL, TEST_HEADS

ATOL, RTOL = 1e-5, 1e-4
# The lone MHA in both causal mask modes, and a 2-layer decoder stack (causal self-attention over padded
# targets, cross-attention over padded memory).
KV_SIGNATURES = [Signature("self", mask, kv_cache=True) for mask in ("causal", "padding-causal")] + [KV_DECODER]
CASES = [
    CacheCase(1, 5, 4, 3, "none"),
    CacheCase(1, 1, 6, 2, "none"),
    CacheCase(3, 11, 5, 4, "right"),
    CacheCase(4, 9, 3, 6, "left"),
    CacheCase(5, 13, 4, 2, "mixed"),
]
# None: ORT allocates each present; 8: preallocated, too small for most cases (the buffers grow); 64: never grows.
CAPACITIES = [None, 8, 64]


@pytest.fixture(scope="module")
def kv_model(export_model):
    """``kv_model(mask) -> (session, cache-free torch reference)``."""
    sessions = {}

    def load(signature: Signature):
        if signature not in sessions:
            path, module = export_model(signature)
            reference = module if signature.model != "mha" else attention_graph(module.mha, signature.cache_free)
            sessions[signature] = (MHASession(path, provider="cpu"), reference)
        return sessions[signature]

    return load


def _memory(feeds: dict) -> dict:
    """A decoder stack's prefill arguments beyond x: its memory and memory_padding_mask."""
    return {name: feeds[name] for name in ("memory", "memory_padding_mask") if name in feeds}


def _decode(decoder, feeds: dict, case: CacheCase, masked: bool) -> np.ndarray:
    x = feeds["x"]
    prefill_mask = feeds["key_padding_mask"][:, : case.prefill] if masked else None
    outputs = [decoder.prefill(x[:, : case.prefill], key_padding_mask=prefill_mask, **_memory(feeds))]
    start = case.prefill
    for length in case.calls[1:]:
        outputs.append(decoder.step(x[:, start : start + length]))
        start += length
    return np.concatenate(outputs, axis=1)


# A causal-only model has no mask: it decodes rows of one length only.
DECODINGS = [
    pytest.param(signature, case, id=f"{signature.model}-{signature.mask}-{case.batch}x{case.prefill}+{case.steps}"
                                     f"+{case.chunk}-{case.padding}")
    for signature in KV_SIGNATURES
    for case in CASES
    if signature.has_padding_mask or case.padding == "none"
]


@pytest.mark.parametrize("capacity", CAPACITIES, ids=lambda c: f"capacity-{c}")
@pytest.mark.parametrize(("signature", "case"), DECODINGS)
def test_decoding_equals_the_full_causal_forward(kv_model, signature, case, capacity):
    session, reference = kv_model(signature)
    full_signature = signature.cache_free
    feeds = full_sequence_inputs(full_signature, TEST_D_MODEL, case, seed=11)
    decoder = session.decoder(capacity=capacity)
    actual = {"output": _decode(decoder, feeds, case, signature.has_padding_mask)}
    expected = torch_reference(reference, full_signature, feeds)
    rows = real_query_rows(full_signature, feeds)
    for comparison in compare_outputs(full_signature, actual, expected, rows, ATOL, RTOL):
        assert comparison.passed, comparison.summary()
    assert decoder.width == sum(case.calls)
    np.testing.assert_array_equal(decoder.lengths, rows.sum(axis=1))
    d_k = TEST_D_MODEL // TEST_HEADS
    for name, cache in decoder.cache.items():
        length = sum(case.calls) if name in signature.growing_caches else case.memory
        assert cache.shape == (case.batch, TEST_HEADS, length, d_k), name


@pytest.mark.parametrize("capacity", CAPACITIES, ids=lambda c: f"capacity-{c}")
@pytest.mark.parametrize("signature", KV_SIGNATURES[1:], ids=lambda s: s.model)
def test_finished_rows_leave_the_batch(kv_model, signature, capacity):
    """Rows that stay decode on exactly as they would have with the whole batch (a decoder's memory too)."""
    session, reference = kv_model(signature)
    full_signature = signature.cache_free
    case = CacheCase(4, 7, 5, 1, "mixed")
    feeds = full_sequence_inputs(full_signature, TEST_D_MODEL, case, seed=3)
    expected = torch_reference(reference, full_signature, feeds)["output"]
    x, mask = feeds["x"], feeds["key_padding_mask"]
    decoder = session.decoder(capacity=capacity)
    decoder.prefill(x[:, :7], key_padding_mask=mask[:, :7], **_memory(feeds))
    decoder.step(x[:, 7:8])
    decoder.leave([0, 2])
    np.testing.assert_array_equal(decoder.ids, [1, 3])
    for position in range(8, 12):
        out = decoder.step(x[decoder.ids, position : position + 1])
        np.testing.assert_allclose(out[:, 0], expected[decoder.ids, position], atol=ATOL, rtol=RTOL)
    decoder.leave([1])
    out = decoder.step(x[decoder.ids, 12:13])
    np.testing.assert_allclose(out[:, 0], expected[[1], 12], atol=ATOL, rtol=RTOL)


def test_lengths_give_right_padding(kv_model):
    session, _ = kv_model(KV_SIGNATURES[1])
    x = np.random.default_rng(0).standard_normal((2, 5, TEST_D_MODEL)).astype(np.float32)
    by_lengths, by_mask = session.decoder(), session.decoder()
    a = by_lengths.prefill(x, lengths=[5, 2])
    b = by_mask.prefill(x, key_padding_mask=np.array([[1] * 5, [1, 1, 0, 0, 0]], bool))
    np.testing.assert_array_equal(a[:, :2], b[:, :2])
    np.testing.assert_array_equal(by_lengths.lengths, [5, 2])


def test_preallocated_cache_is_written_in_place(kv_model):
    """With a capacity, steps reuse two buffers: present lands where the next call's past is read from."""
    session, _ = kv_model(KV_SIGNATURES[0])
    decoder = session.decoder(capacity=32)
    rng = np.random.default_rng(1)
    decoder.prefill(rng.standard_normal((2, 4, TEST_D_MODEL)).astype(np.float32))
    bases = set()
    for _ in range(6):
        decoder.step(rng.standard_normal((2, 1, TEST_D_MODEL)).astype(np.float32))
        bases.add(decoder.cache["past_key"].__array_interface__["data"][0])
    assert len(bases) == 2


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda d, x: d.step(x[:, :1]), "call prefill first"),
        (lambda d, x: d.prefill(x, lengths=[3, 0]), "lengths must be 2 values"),
        (lambda d, x: d.prefill(x, key_padding_mask=np.ones((2, 2), bool)), "key_padding_mask must be"),
        (lambda d, x: d.prefill(x, key_padding_mask=np.zeros((2, 3), bool)), "no real token"),
        (lambda d, x: d.prefill(x[0]), "rank 3"),
    ],
)
def test_decoder_refuses_bad_calls(kv_model, call, message):
    session, _ = kv_model(KV_SIGNATURES[1])
    x = np.zeros((2, 3, TEST_D_MODEL), np.float32)
    with pytest.raises(InputError, match=message):
        call(session.decoder(), x)


def test_causal_only_model_refuses_padded_prefill(kv_model):
    session, _ = kv_model(KV_SIGNATURES[0])
    with pytest.raises(InputError, match="no key_padding_mask"):
        session.decoder().prefill(np.zeros((2, 3, TEST_D_MODEL), np.float32), lengths=[3, 1])


def test_step_must_cover_every_active_row(kv_model):
    session, _ = kv_model(KV_SIGNATURES[1])
    decoder = session.decoder()
    decoder.prefill(np.zeros((3, 2, TEST_D_MODEL), np.float32))
    with pytest.raises(InputError, match="batch=3"):
        decoder.step(np.zeros((2, 1, TEST_D_MODEL), np.float32))


def test_a_model_without_cache_has_no_decoder(export_model):
    session = MHASession(export_model(Signature("self", "causal"))[0], provider="cpu")
    with pytest.raises(OptionError, match="--kv-cache"):
        session.decoder()


def test_run_into_refuses_a_wrong_output_shape(kv_model):
    session, _ = kv_model(KV_SIGNATURES[0])
    x = np.zeros((1, 2, TEST_D_MODEL), np.float32)
    empty = np.zeros((1, TEST_HEADS, 0, TEST_D_MODEL // TEST_HEADS), np.float32)
    wrong = np.zeros((1, TEST_HEADS, 3, TEST_D_MODEL // TEST_HEADS), np.float32)
    with pytest.raises(InputError, match="run_into"):
        session.run_into({"x": x, "past_key": empty, "past_value": empty}, {"present_key": wrong})


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda d, x, m: d.prefill(x), "needs memory"),
        (lambda d, x, m: d.prefill(x, memory=m[:1]), r"memory must be \[batch=2"),
        (lambda d, x, m: d.prefill(x, memory=m, memory_padding_mask=np.zeros((2, 4), bool)), "no real token"),
    ],
)
def test_decoder_stack_prefill_needs_its_memory(kv_model, call, message):
    session, _ = kv_model(KV_DECODER)
    x, memory = np.zeros((2, 3, TEST_D_MODEL), np.float32), np.zeros((2, 4, TEST_D_MODEL), np.float32)
    with pytest.raises(InputError, match=message):
        call(session.decoder(), x, memory)


def test_a_lone_attention_takes_no_memory(kv_model):
    session, _ = kv_model(KV_SIGNATURES[0])
    x = np.zeros((1, 3, TEST_D_MODEL), np.float32)
    with pytest.raises(InputError, match="no memory"):
        session.decoder().prefill(x, memory=x)


@pytest.mark.parametrize(
    ("encoder_length", "past_seq", "message"),
    [(4, 0, "must be 0 long on the first call"), (0, 2, r"must be 4 long on later calls \(memory's length\)")],
)
def test_encoder_caches_are_empty_only_on_the_first_call(kv_model, encoder_length, past_seq, message):
    """The graph picks its branch by past_seq: encoder caches that disagree with it are refused, not misread."""
    session, _ = kv_model(KV_DECODER)
    d_k = TEST_D_MODEL // TEST_HEADS
    feeds = {
        "x": np.zeros((1, 1, TEST_D_MODEL), np.float32),
        "memory": np.zeros((1, 4, TEST_D_MODEL), np.float32),
        "key_padding_mask": np.ones((1, past_seq + 1), bool),
        "memory_padding_mask": np.ones((1, 4), bool),
    }
    for past in session.signature.cache_pairs:
        length = past_seq if past in session.signature.growing_caches else encoder_length
        feeds[past] = np.zeros((1, TEST_HEADS, length, d_k), np.float32)
    with pytest.raises(InputError, match=message):
        session.run(feeds)
