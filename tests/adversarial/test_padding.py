"""Round 2, defects 5 and 6: what sits at padded positions, and which rows leave a decoder.

- NaN or Inf at positions a padding mask marks (through ``MHASession.run`` or
  ``Decoder.prefill``, or in a masked slot of a cache) made real rows NaN, and
  every later decode step; the mask hides a position from attention, but
  NaN x 0 is still NaN. Padded positions are now zeroed before they reach ORT.
- ``decoder.leave(np.array([False, True, False]))`` was read as indices 0, 1, 0.
"""

from __future__ import annotations

import numpy as np
import pytest

from mha_deploy.errors import InputError
from mha_deploy.metadata import Signature
from mha_deploy.runtime import MHASession
from tests.conftest import KV_DECODER, TEST_D_MODEL

D = TEST_D_MODEL
POISONS = [np.nan, np.inf, -np.inf, 3e38]
KV_PADDED = Signature("self", "padding-causal", kv_cache=True)


@pytest.fixture(scope="module")
def load(export_model):
    sessions = {}

    def session(signature: Signature) -> MHASession:
        if signature not in sessions:
            sessions[signature] = MHASession(export_model(signature)[0], provider="cpu")
        return sessions[signature]

    return session


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _poisoned(array: np.ndarray, mask: np.ndarray, value: float) -> np.ndarray:
    """``array`` [batch, seq, ...] with ``value`` at every position ``mask`` [batch, seq] marks as padding."""
    out = array.copy()
    out[~mask] = value
    return out


@pytest.mark.parametrize("value", POISONS, ids=str)
@pytest.mark.parametrize("signature", [Signature("self", "padding"), Signature("cross", "padding"),
                                       Signature("self", "padding-causal")], ids=lambda s: f"{s.attention}-{s.mask}")
def test_session_run_ignores_whatever_sits_at_padded_positions(load, signature, value):
    session = load(signature)
    rng = _rng()
    mask = np.array([[True] * 5 + [False] * 2, [False, False] + [True] * 5])  # right and left padding
    feeds = {name: rng.standard_normal((2, 7, D), dtype=np.float32) for name in signature.sequence_inputs}
    feeds["key_padding_mask"] = mask
    clean = session.run(feeds)["output"]
    masked_input = "x" if signature.attention == "self" else "key"
    poisoned = dict(feeds)
    for name in (masked_input, "value") if signature.attention == "cross" else (masked_input,):
        poisoned[name] = _poisoned(feeds[name], mask, value)
    before = {name: array.copy() for name, array in poisoned.items()}
    out = session.run(poisoned)["output"]
    rows = mask if signature.attention == "self" else np.ones((2, 7), bool)  # cross: every query row is real
    assert np.isfinite(out[rows]).all()
    np.testing.assert_allclose(out[rows], clean[rows], atol=1e-5, rtol=1e-5)
    for name, array in before.items():  # the caller's arrays are left as they were
        np.testing.assert_array_equal(poisoned[name], array)


@pytest.mark.parametrize("capacity", [None, 16])
@pytest.mark.parametrize("value", POISONS[:2], ids=str)
def test_a_poisoned_prefill_leaves_every_later_step_finite(load, value, capacity):
    session = load(KV_PADDED)
    rng = _rng(1)
    x = rng.standard_normal((2, 6, D), dtype=np.float32)
    mask = np.array([[True] * 6, [False, False, True, True, True, True]])
    steps = rng.standard_normal((2, 3, D), dtype=np.float32)
    outputs = {}
    for label, prefill in (("clean", x), ("poisoned", _poisoned(x, mask, value))):
        decoder = session.decoder(capacity=capacity)
        first = decoder.prefill(prefill, key_padding_mask=mask)
        outputs[label] = [first[mask]] + [decoder.step(steps[:, i : i + 1]) for i in range(3)]
    for clean, poisoned in zip(outputs["clean"], outputs["poisoned"], strict=True):
        assert np.isfinite(poisoned).all()
        np.testing.assert_allclose(poisoned, clean, atol=1e-5, rtol=1e-5)


def test_a_decoder_stacks_padded_memory_is_inert(load):
    session = load(KV_DECODER)
    rng = _rng(2)
    x = rng.standard_normal((2, 4, D), dtype=np.float32)
    memory = rng.standard_normal((2, 5, D), dtype=np.float32)
    memory_mask = np.array([[True] * 5, [True, True, True, False, False]])
    outs = []
    for mem in (memory, _poisoned(memory, memory_mask, np.nan)):
        decoder = session.decoder()
        outs.append(decoder.prefill(x, memory=mem, memory_padding_mask=memory_mask))
        outs.append(decoder.step(x[:, :1]))
    assert np.isfinite(outs[2]).all() and np.isfinite(outs[3]).all()
    np.testing.assert_allclose(outs[2], outs[0], atol=1e-5)
    np.testing.assert_allclose(outs[3], outs[1], atol=1e-5)


@pytest.mark.parametrize("value", POISONS[:2], ids=str)
def test_an_inf_in_a_masked_cache_slot_is_inert(load, value):
    session = load(KV_PADDED)
    rng = _rng(3)
    heads = session.metadata.num_heads
    d_k = D // heads
    past = {name: rng.standard_normal((1, heads, 4, d_k), dtype=np.float32) for name in ("past_key", "past_value")}
    mask = np.array([[True, False, True, True, True]])  # cache slot 1 is a hole
    feeds = {"x": rng.standard_normal((1, 1, D), dtype=np.float32), "key_padding_mask": mask, **past}
    clean = session.run(feeds)["output"]
    for name in past:
        feeds[name] = past[name].copy()
        feeds[name][:, :, 1] = value
    out = session.run(feeds)["output"]
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, clean, atol=1e-5)


def test_leave_takes_a_bool_mask_as_a_mask(load):
    session = load(KV_PADDED)
    x = _rng(4).standard_normal((3, 2, D), dtype=np.float32)
    decoder = session.decoder()
    decoder.prefill(x)
    decoder.leave(np.array([False, True, False]))
    np.testing.assert_array_equal(decoder.ids, [0, 2])
    decoder.leave([True, False])
    np.testing.assert_array_equal(decoder.ids, [2])


@pytest.mark.parametrize(("rows", "message"), [
    (np.array([0.9]), "integer indices"),
    ([0.0], "integer indices"),
    (np.array([True, False]), "one value per row"),
    ([5], "out of range"),
])
def test_leave_refuses_what_is_neither_indices_nor_a_mask(load, rows, message):
    session = load(KV_PADDED)
    decoder = session.decoder()
    decoder.prefill(_rng(5).standard_normal((3, 2, D), dtype=np.float32))
    with pytest.raises(InputError, match=message):
        decoder.leave(rows)
    np.testing.assert_array_equal(decoder.ids, [0, 1, 2])
