"""BatchRunner and item files: batched results equal one-by-one results, whatever the padding."""

from __future__ import annotations

import numpy as np
import pytest

from mha_deploy.batch import BatchRunner
from mha_deploy.batching import RunnerOptions
from mha_deploy.errors import InputError
from mha_deploy.metadata import Signature
from mha_deploy.runtime import MHASession
from tests.conftest import SIGNATURES, TEST_D_MODEL, USER_TARGETS, signature_id

D = TEST_D_MODEL
LENGTHS = [5, 1, 17, 5, 9, 33, 2, 17, 1, 40]


def make_items(signature: Signature, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    items = {}
    for index, length in enumerate(LENGTHS):
        lengths = signature.axis_sizes(1, length, LENGTHS[-1 - index])
        items[f"item-{index}"] = {
            name: rng.standard_normal((lengths[signature.axis_of(name)], D), dtype=np.float32)
            for name in signature.sequence_inputs
        }
    return items


def run_one(session: MHASession, item: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    feeds = {name: array[None] for name, array in item.items()}
    for mask_name, sequence_name in session.signature.padding_masks.items():
        feeds[mask_name] = np.ones((1, item[sequence_name].shape[0]), bool)
    return {name: out[0] for name, out in session.run(feeds).items()}


WITH_WEIGHTS = [Signature("self", "padding", True), Signature("cross", "padding", True)]


@pytest.mark.parametrize("fuse", USER_TARGETS)
@pytest.mark.parametrize("signature", SIGNATURES + WITH_WEIGHTS, ids=signature_id)
def test_batched_equals_one_by_one(export_model, signature, fuse):
    session = MHASession(export_model(signature, fuse)[0], provider="cpu")
    items = make_items(signature)
    results, stats = BatchRunner(session, batch_size=4).run(items)
    assert list(results) == list(items), "results come back in input order"
    for item_id, item in items.items():
        expected = run_one(session, item)
        for name, array in expected.items():
            np.testing.assert_allclose(results[item_id][name], array, atol=1e-5, rtol=1e-4, err_msg=item_id)
    assert stats.items == len(items) and stats.tokens == sum(LENGTHS)
    assert 0 <= stats.padding_ratio < 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a[:, :-1], r"item 'item-3': x has d_model 63, this model expects 64"),
        (lambda a: a > 0, r"item 'item-3': x holds bool: expected an array of numbers"),
        (lambda a: a[:0], r"item 'item-3': x is empty"),
        (lambda a: np.where(np.arange(len(a))[:, None] == 0, np.nan, a).astype(np.float32), "NaN or Inf"),
        (lambda a: a[0], r"item 'item-3': x has shape \(64,\), expected \[seq, 64\]"),
    ],
)
def test_bad_item_is_named(export_model, change, message):
    session = MHASession(export_model(Signature("self", "padding"))[0], provider="cpu")
    items = make_items(Signature("self", "padding"))
    items["item-3"]["x"] = change(items["item-3"]["x"])
    with pytest.raises(InputError, match=message):
        BatchRunner(session).run(items)



@pytest.mark.parametrize("on_error", ["stop", "skip"])
def test_fp16_model_takes_float32_items(export_model, on_error):
    """Datasets hold float32 whatever the model's dtype: items are cast, and an overflow is a bad item, not inf."""
    signature = Signature("self", "padding")
    half = MHASession(export_model(signature, dtype="fp16")[0], provider="cpu")
    full = MHASession(export_model(signature)[0], provider="cpu")
    items = make_items(signature)
    results, stats = BatchRunner(half, batch_size=3, on_error=on_error).run(items)
    expected, _ = BatchRunner(full, batch_size=3).run(items)
    assert list(results) == list(items) and stats.errors == []
    for item_id in items:
        assert results[item_id]["output"].dtype == np.float16
        # fp16 weights and activations against the fp32 model: the fp16 export's parity tolerance.
        np.testing.assert_allclose(results[item_id]["output"], expected[item_id]["output"], atol=5e-3, rtol=5e-3)
    items["item-3"]["x"] = np.full_like(items["item-3"]["x"], 1e5)  # finite in float32, inf in float16
    runner = BatchRunner(half, on_error=on_error)
    if on_error == "stop":
        with pytest.raises(InputError, match="item 'item-3': x contains NaN or Inf"):
            runner.run(items)
    else:
        assert [e.item_id for e in runner.run(items)[1].errors] == ["item-3"]


@pytest.mark.parametrize("signature", [Signature("self", "padding"), Signature("cross", "none")], ids=signature_id)
def test_bucketing_pads_less_and_gives_the_same_results(export_model, signature):
    session = MHASession(export_model(signature)[0], provider="cpu")
    items = make_items(signature)
    naive, naive_stats = BatchRunner(session, batch_size=3, bucket_window=0).run(items)
    for window in (1, 4, 256):
        results, _ = BatchRunner(session, batch_size=3, max_batch_tokens=80, bucket_window=window).run(items)
        assert list(results) == list(items)
        for item_id in items:
            np.testing.assert_allclose(results[item_id]["output"], naive[item_id]["output"], atol=1e-5, rtol=1e-4)
    _, bucketed_stats = BatchRunner(session, batch_size=3, bucket_window=256).run(items)
    if signature.key_axis in signature.paddable_axes:
        assert bucketed_stats.padding_ratio < naive_stats.padding_ratio
    else:  # in input order unequal key lengths cannot share a batch: more batches, each of one length
        assert len(bucketed_stats.batch_ms) < len(naive_stats.batch_ms)


def test_skip_leaves_bad_items_out(export_model):
    session = MHASession(export_model(Signature("self", "padding"))[0], provider="cpu")
    items = make_items(Signature("self", "padding"))
    items["item-3"]["x"] = items["item-3"]["x"][:0]
    results, stats = BatchRunner(session, on_error="skip").run(items)
    assert "item-3" not in results and len(results) == len(items) - 1
    assert [(e.item_id, e.message) for e in stats.errors] == [
        ("item-3", "item 'item-3': x is empty: a sequence needs at least one token")
    ]
    summary = stats.to_dict()
    assert summary["items"] == len(items) - 1 and summary["batch_ms_p99"] >= summary["batch_ms_p50"] > 0
    assert "p50" in stats.summary() and "1 bad items skipped" in stats.summary()


@pytest.mark.parametrize("on_error", ["stop", "skip"])
def test_outputs_that_overflow_are_bad_items(export_model, on_error):
    """1e30 is a finite float32, but its attention scores are not: NaN out, which is never returned."""
    session = MHASession(export_model(Signature("self", "padding"))[0], provider="cpu")
    items = make_items(Signature("self", "padding"))
    items["item-3"]["x"] = np.full_like(items["item-3"]["x"], 1e30)
    runner = BatchRunner(session, batch_size=4, on_error=on_error)
    message = "item 'item-3': output holds NaN or Inf although every input value is finite"
    if on_error == "stop":
        with pytest.raises(InputError, match=message):
            runner.run(items)
        return
    results, stats = runner.run(items)
    assert list(results) == [item_id for item_id in items if item_id != "item-3"]
    assert all(np.isfinite(r["output"]).all() for r in results.values())
    assert [e.item_id for e in stats.errors] == ["item-3"] and stats.errors[0].message.startswith(message)
    assert stats.items == len(items) - 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"batch_size": 0}, "batch size must be at least 1"),
        ({"batch_size": None}, "batch size, a token budget"),
        ({"max_batch_tokens": 0}, "max batch tokens must be at least 1"),
        ({"bucket_window": -1}, "bucket window"),
        ({"on_error": "ignore"}, "on_error must be one of"),
    ],
)
def test_runner_options_are_checked(export_model, options, message):
    session = MHASession(export_model(Signature("self", "padding"))[0], provider="cpu")
    with pytest.raises(InputError, match=message):
        BatchRunner(session, **options)
    with pytest.raises(InputError, match=message):
        RunnerOptions(**options)


def test_serving_imports_no_heavy_optional_modules():
    import subprocess
    import sys

    code = (
        "import sys, mha_deploy.serving, mha_deploy.batch.job, mha_deploy.batch.datasets; "
        "print(sorted({'torch', 'pyarrow', 'ray'} & set(sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_runner_refuses_a_kv_cache_model(export_model):
    from mha_deploy.errors import OptionError

    session = MHASession(export_model(Signature("self", "causal", kv_cache=True))[0], provider="cpu")
    with pytest.raises(OptionError, match="decoder"):
        BatchRunner(session)
