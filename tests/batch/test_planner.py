"""The one batch planner: what may share a batch, under the runner's and the server's limits."""

from __future__ import annotations

import numpy as np
import pytest

from mha_deploy.batch.planner import BatchLimits, collate, plan_batches, split_outputs
from mha_deploy.metadata import Signature
from tests.batch.test_runner import make_items
from tests.conftest import SIGNATURES, signature_id

PADDED = Signature("self", "padding")
DECODER = Signature("cross", "none", model="decoder")


def _self_items(*lengths) -> list[dict[str, np.ndarray]]:
    return [{"x": np.zeros((n, 2), np.float32)} for n in lengths]


@pytest.mark.parametrize("signature", [*SIGNATURES, DECODER], ids=signature_id)
def test_unpaddable_axes_never_mix_lengths(signature):
    items = list(make_items(signature).values())
    batches = plan_batches(items, signature, BatchLimits(batch_size=4))
    assert sorted(i for b in batches for i in b) == list(range(len(items)))
    assert all(len(b) <= 4 for b in batches)
    for name in signature.sequence_inputs:
        if signature.axis_of(name) not in signature.paddable_axes:
            assert all(len({items[i][name].shape[0] for i in b}) == 1 for b in batches), name


@pytest.mark.parametrize(
    ("signature", "paddable"),
    [
        (Signature("self", "none"), set()),
        (Signature("self", "padding"), {"seq"}),
        (Signature("self", "causal"), {"seq"}),  # right padding comes after every real query
        (Signature("cross", "none"), {"q_seq"}),  # queries never influence each other
        (Signature("cross", "padding"), {"q_seq", "kv_seq"}),
        (DECODER, {"tgt_seq"}),  # causal self-attention; memory has no mask
        (Signature("cross", "padding", model="decoder"), {"tgt_seq", "mem_seq"}),
    ],
    ids=lambda value: signature_id(value) if isinstance(value, Signature) else "",
)
def test_paddable_axes(signature, paddable):
    assert signature.paddable_axes == paddable


def test_token_budget_bounds_padded_positions():
    items = _self_items(3, 9, 4, 20, 2, 8, 8, 1)
    batches = plan_batches(items, PADDED, BatchLimits(max_batch_tokens=16))
    assert sorted(i for b in batches for i in b) == list(range(len(items)))
    for batch in batches:
        longest = max(items[i]["x"].shape[0] for i in batch)
        assert len(batch) * longest <= 16 or len(batch) == 1, "only an item longer than the budget goes over it"
    assert [3] in batches, "the 20-token item goes alone"
    assert all(len(b) <= 2 for b in plan_batches(items, PADDED, BatchLimits(batch_size=2, max_batch_tokens=16)))


def test_without_sorting_batches_keep_input_order():
    items = _self_items(5, 1, 7, 2, 2)
    assert plan_batches(items, PADDED, BatchLimits(batch_size=2), sort=False) == [[0, 1], [2, 3], [4]]
    assert plan_batches(items, PADDED, BatchLimits(batch_size=2)) == [[1, 3], [4, 0], [2]]


def test_padding_budget_keeps_long_items_apart():
    # Similar lengths share a run; a long one does not drag the short ones to its length.
    batches = plan_batches(_self_items(10, 200, 11, 12, 190), PADDED, BatchLimits(max_padding=0.1))
    assert sorted(sorted(b) for b in batches) == [[0, 2, 3], [1, 4]]
    # A few positions of padding per item are always fine, whatever the share.
    assert plan_batches(_self_items(1, 3, 5, 8), PADDED, BatchLimits(max_padding=0.0)) == [[0, 1, 2, 3]]
    planned = plan_batches(_self_items(*[100] * 5), PADDED, BatchLimits(max_batch_tokens=250))
    assert [len(b) for b in planned] == [2, 2, 1]
    assert plan_batches(_self_items(300), PADDED, BatchLimits(max_batch_tokens=250)) == [[0]]
    # Without a mask keys cannot be padded: one run per length.
    batches = plan_batches(_self_items(5, 6, 5, 6, 7), Signature("self", "none"), BatchLimits(max_padding=0.5))
    assert sorted(sorted(b) for b in batches) == [[0, 2], [1, 3], [4]]


@pytest.mark.parametrize(
    "signature", [Signature("cross", "padding", True), Signature("cross", "padding", model="decoder")], ids=signature_id
)
def test_collate_masks_padding_and_split_cuts_it_off(signature):
    items = list(make_items(signature).values())[:3]
    batch = collate(items, signature)
    for mask_name, sequence_name in signature.padding_masks.items():
        assert batch.feeds[mask_name].sum(axis=1).tolist() == [item[sequence_name].shape[0] for item in items]
    # Outputs shaped as the model would return them, filled with each position's index, to check the cuts.
    sizes = {axis: batch.feeds[signature.sequence_inputs[0]].shape[0] for axis in ("batch",)}
    sizes |= {signature.axis_of(name): array.shape[1] for name, array in batch.feeds.items()}
    sizes |= {"d_model": 3, "heads": 2}
    outputs = {spec.name: np.zeros(spec.shape(sizes), np.float32) for spec in signature.outputs}
    for row, result in enumerate(split_outputs(outputs, batch, signature)):
        q_len = items[row][signature.query_input].shape[0]
        assert result["output"].shape == (q_len, 3)
        if "attn_weights" in result:
            assert result["attn_weights"].shape == (2, q_len, items[row]["key"].shape[0])


def test_padded_batches_stay_within_the_score_budget():
    """Padding masked keys costs batch x heads x q x kv scores; equal lengths take the flash path and cost none."""
    limits = BatchLimits(max_score_bytes=4 * 1000 * 1000 * 4, score_bytes=4 * 4)  # 4 heads, float32
    mixed = plan_batches(_self_items(1000, 990, 1000, 995), PADDED, limits)
    assert all(len(b) == 1 or len({[1000, 990, 1000, 995][i] for i in b}) == 1 for b in mixed), mixed
    # 4 x 1000 x 1000 x 16 bytes = 64 MB > the 16 MB budget only if padded: equal lengths go together.
    assert plan_batches(_self_items(1000, 1000, 1000, 1000), PADDED, limits) == [[0, 1, 2, 3]]
    # A model without a padding mask pads no masked key: the budget does not apply.
    causal = Signature("self", "causal")
    assert plan_batches(_self_items(1000, 990), causal, limits) == [[1, 0]]
