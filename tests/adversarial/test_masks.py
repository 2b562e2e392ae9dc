"""Attacks through padding masks: a model taking two masks of one axis, and masks where the batch readers take
none. A padded position is one every mask of its axis calls padding; a mask no reader can honour is refused."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from mha_deploy.batching import BatchingConfig  # noqa: E402
from mha_deploy.exporters import export_model  # noqa: E402
from mha_deploy.exporters.parity import default_cases  # noqa: E402
from mha_deploy.inputs import make_inputs  # noqa: E402
from mha_deploy.runtime import MHASession  # noqa: E402
from tests.conftest import OWN_MODEL_ATOL, OWN_MODEL_RTOL  # noqa: E402

VOCAB, WIDTH, HEADS = 20, 16, 2


class _Attention(nn.Module):
    """The reference form: projections, masked_fill(mask == 0, -1e9), softmax."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x, mask):
        batch = x.size(0)
        q, k, v = (t.view(batch, -1, HEADS, WIDTH // HEADS).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(WIDTH // HEADS)
        scores = scores.masked_fill(mask[:, None, None, :] == 0, -1e9)
        out = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).reshape(batch, -1, WIDTH)
        return self.out(out)


class TwoMasks(nn.Module):
    """Attends to every token either mask calls real (say an attention mask and a mask of prompt tokens)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.attention, self.head = nn.Embedding(VOCAB, WIDTH), _Attention(), nn.Linear(WIDTH, 3)

    def forward(self, ids, mask1, mask2):
        return self.head(self.attention(self.embed(ids), mask1 | mask2))


TWO_MASKS = ["ids:tokens", "mask1:padding-mask", "mask2:padding-mask"]


@pytest.fixture(scope="session")
def two_masks(tmp_path_factory):
    path = tmp_path_factory.mktemp("two-masks") / "two_masks.onnx"
    result = export_model(TwoMasks(), path, TWO_MASKS)
    return path, result


def _differing_masks(seed: int = 0) -> dict[str, np.ndarray]:
    """Three rows of 9 tokens: mask1 right-padded at 5, mask2 real at 5..7 only, and a row only mask1 marks."""
    rng = np.random.default_rng(seed)
    mask1 = np.zeros((3, 9), bool)
    mask1[:, :5] = True
    mask2 = np.zeros((3, 9), bool)
    mask2[:2, 5:8] = True
    return {"ids": rng.integers(1, VOCAB, (3, 9)), "mask1": mask1, "mask2": mask2}


def _module_answer(feeds: dict[str, np.ndarray]) -> np.ndarray:
    with torch.no_grad():
        return TwoMasks().eval()(*(torch.from_numpy(feeds[name]) for name in ("ids", "mask1", "mask2"))).numpy()


def _served(session: MHASession, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """``feeds`` as one Open Inference Protocol request (REST and gRPC share this core) through the batcher."""
    from mha_deploy.serving.http import v2
    from mha_deploy.serving.http.batcher import MicroBatcher

    async def serve():
        batcher = MicroBatcher(session, BatchingConfig(max_wait_ms=2))
        await batcher.start()
        try:
            plan = v2.plan_request(session.metadata, feeds, max_item_tokens=1024)
            return await v2.run_plan(plan, batcher, session.metadata)
        finally:
            await batcher.stop()

    return asyncio.run(serve())["output"]


@pytest.mark.parametrize("path", ["session", "v2 server"])
def test_two_masks_of_one_axis_pad_only_where_both_say_padding(two_masks, path):
    model, result = two_masks
    assert result.parity.passed
    session = MHASession(model, provider="cpu")
    feeds = _differing_masks()
    got = session.run(feeds)["output"] if path == "session" else _served(session, feeds)
    real = feeds["mask1"] | feeds["mask2"]
    np.testing.assert_allclose(got[real], _module_answer(feeds)[real], atol=OWN_MODEL_ATOL, rtol=OWN_MODEL_RTOL)


def test_parity_draws_masks_of_one_axis_that_differ_both_ways(two_masks):
    """Parity's shapes give two masks of one axis different real lengths, each the longer in some row: a graph
    that honoured one mask only would fail it."""
    signature = two_masks[1].metadata.signature
    longer1 = longer2 = 0
    for index, case in enumerate(default_cases(signature)):
        feeds = make_inputs(signature, WIDTH, case, seed=index)
        lengths1, lengths2 = feeds["mask1"].sum(axis=1), feeds["mask2"].sum(axis=1)
        longer1, longer2 = longer1 + int((lengths1 > lengths2).sum()), longer2 + int((lengths2 > lengths1).sum())
    assert longer1 and longer2, (longer1, longer2)


def test_an_axis_with_two_masks_is_not_token_packed(two_masks):
    """Packing gathers the real tokens of one mask: positions only the other mask calls real would be lost."""
    from mha_deploy.exporters.token_packing import packing_masks

    signature = two_masks[1].metadata.signature
    assert "seq" in signature.paddable_axes
    assert packing_masks(signature) == []
