"""Attacks through padding masks: a model taking two masks of one axis, and masks in datasets, whose items are
unpadded. A padded position is one every mask of its axis calls padding; a mask in a dataset is refused."""

from __future__ import annotations

import asyncio
import json
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
from tests.adversarial.conftest import assert_loud, infer  # noqa: E402
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


def _write_items_with_masks(source, ids: dict[str, np.ndarray], masks: dict[str, np.ndarray]) -> None:
    """The classifier's items as a tokenizer hands them out, each with its attention_mask beside its ids."""
    if source.suffix == ".parquet":
        pa = pytest.importorskip("pyarrow")
        pq = pytest.importorskip("pyarrow.parquet")
        table = pa.table({"id": list(ids), "input_ids": [a.tolist() for a in ids.values()],
                          "attention_mask": [m.astype(np.int64).tolist() for m in masks.values()]})
        pq.write_table(table, source)
        return
    if source.suffix == ".jsonl":
        source.write_text("".join(json.dumps({"id": key, "input_ids": ids[key].tolist(),
                                              "attention_mask": masks[key].astype(int).tolist()}) + "\n"
                                  for key in ids))
        return
    from mha_deploy.batch.items import write_arrays

    write_arrays(source, {**ids, **{f"{key}.attention_mask": mask for key, mask in masks.items()}})


@pytest.mark.parametrize("suffix", [".parquet", ".npz", ".safetensors", ".jsonl"])
def test_a_padding_mask_in_a_dataset_is_refused_in_one_line_naming_it(own_model, tmp_path, suffix):
    """Items are unpadded and infer builds every batch's masks itself: a mask per item (zeros in it) would be
    ignored and the padding it marks read as real tokens, so it is refused, as /v1 refuses it."""
    model = own_model("classifier")[0]
    source, output = tmp_path / f"in{suffix}", tmp_path / f"out{'.npz' if suffix == '.jsonl' else suffix}"
    ids = {"a": np.array([5, 9, 2, 0, 0]), "b": np.array([7, 3, 4])}
    masks = {"a": np.array([1, 1, 1, 0, 0], bool), "b": np.ones(3, bool)}
    _write_items_with_masks(source, ids, masks)
    where = {".parquet": "column attention_mask", ".jsonl": "line 1: field attention_mask"}.get(
        suffix, "key 'a.attention_mask'")
    assert_loud(infer(model, source, output), f"{source}: {where}: attention_mask is this model's padding mask",
                "remove it and keep only each item's real tokens")
    assert not output.exists()
