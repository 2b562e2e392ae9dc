"""MHASession under concurrent use, and its options: threads, optimized-model cache, warm-up, IO binding, CUDA graph."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from mha_deploy.errors import InputError, OptionError, ProviderUnavailableError
from mha_deploy.metadata import Signature
from mha_deploy.runtime import MHASession
from tests.conftest import TEST_D_MODEL, signature_id

D = TEST_D_MODEL
THREADS, CALLS = 16, 50
CONCURRENT_SIGNATURES = [Signature("self", "padding"), Signature("cross", "padding"), Signature("self", "causal", True)]


def make_inputs(signature: Signature, count: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``count`` input dicts of mixed batch sizes and lengths, with ragged padding where the model has a mask."""
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(count):
        batch, q_len, kv_len = int(rng.integers(1, 5)), int(rng.integers(1, 40)), int(rng.integers(1, 40))
        if signature.attention == "self":
            inputs = {"x": rng.standard_normal((batch, q_len, D), dtype=np.float32)}
            kv_len = q_len
        else:
            inputs = {
                "query": rng.standard_normal((batch, q_len, D), dtype=np.float32),
                "key": rng.standard_normal((batch, kv_len, D), dtype=np.float32),
                "value": rng.standard_normal((batch, kv_len, D), dtype=np.float32),
            }
        if signature.has_padding_mask:
            lengths = rng.integers(1, kv_len + 1, size=batch)
            inputs["key_padding_mask"] = np.arange(kv_len)[None, :] < lengths[:, None]
        cases.append(inputs)
    return cases


def run_concurrently(session: MHASession, cases: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """Every case run once, spread over ``THREADS`` threads that start together."""
    start = threading.Barrier(THREADS)
    results: list[dict[str, np.ndarray] | None] = [None] * len(cases)

    def worker(offset: int) -> None:
        start.wait(timeout=30)
        for index in range(offset, len(cases), THREADS):
            results[index] = session.run(cases[index])

    with ThreadPoolExecutor(THREADS) as pool:
        for future in [pool.submit(worker, t) for t in range(THREADS)]:
            future.result(timeout=120)
    return results


@pytest.mark.parametrize("signature", CONCURRENT_SIGNATURES, ids=signature_id)
@pytest.mark.parametrize("io_binding", [False, True], ids=["run", "io_binding"])
def test_concurrent_calls_equal_single_threaded(export_model, signature, io_binding):
    """16 threads × 50 calls of mixed shapes on one session: every result equals the sequential one, bit for bit."""
    session = MHASession(export_model(signature)[0], provider="cpu", threads=2, io_binding=io_binding)
    cases = make_inputs(signature, THREADS * CALLS)
    expected = [session.run(case) for case in cases]
    actual = run_concurrently(session, cases)
    for index, (want, got) in enumerate(zip(expected, actual, strict=True)):
        assert got is not None, f"call {index} returned nothing"
        assert set(got) == set(session.output_names)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"call {index}, output {name}")


def test_io_binding_equals_plain_run(export_model):
    path = export_model(Signature("cross", "padding"))[0]
    case = make_inputs(Signature("cross", "padding"), 1, seed=3)[0]
    plain = MHASession(path, provider="cpu").run(case)["output"]
    bound = MHASession(path, provider="cpu", io_binding=True).run(case)["output"]
    np.testing.assert_array_equal(bound, plain)


def test_optimized_model_cache(export_model, tmp_path):
    """The first session writes the optimized graph, the next loads it (same results); an unreadable one is rebuilt."""
    source = tmp_path / "mha.onnx"
    source.write_bytes(export_model(Signature("self", "padding"))[0].read_bytes())
    cache = tmp_path / "cache" / "mha.opt.onnx"
    case = make_inputs(Signature("self", "padding"), 1, seed=1)[0]

    first = MHASession(source, provider="cpu", optimized_model_path=cache)
    assert cache.is_file() and first.loaded_from == str(source)
    assert not list(cache.parent.glob(".*.tmp*")), "no temporary file is left behind"
    second = MHASession(source, provider="cpu", optimized_model_path=cache)
    assert second.loaded_from == str(cache)
    assert second.metadata == first.metadata
    np.testing.assert_allclose(second.run(case)["output"], first.run(case)["output"], atol=1e-6)

    newer = cache.stat().st_mtime_ns + 10**9
    os.utime(source, ns=(newer, newer))
    touched = MHASession(source, provider="cpu", optimized_model_path=cache)
    assert touched.loaded_from == str(cache), "the cache is keyed by the model's bytes: a touch changes nothing"

    cache.write_bytes(b"not a model")
    fourth = MHASession(source, provider="cpu", optimized_model_path=cache)
    assert fourth.loaded_from == str(source), "an unreadable cache is rebuilt, not fatal"
    assert MHASession(source, provider="cpu", optimized_model_path=cache).loaded_from == str(cache)
    other_level = MHASession(source, provider="cpu", optimization="basic", optimized_model_path=cache)
    assert other_level.loaded_from == str(source), "a cache built at another optimization level is rebuilt"


@pytest.mark.parametrize("signature", [Signature("self", "padding"), Signature("cross", "none")], ids=signature_id)
def test_warmup_and_thread_options(export_model, signature):
    session = MHASession(
        export_model(signature)[0],
        provider="cpu",
        threads=1,
        inter_op_threads=2,
        optimization="extended",
        session_config={"session.intra_op.allow_spinning": "0"},
        warmup=True,
    )
    case = make_inputs(signature, 1, seed=2)[0]
    reference = MHASession(export_model(signature)[0], provider="cpu").run(case)["output"]
    np.testing.assert_allclose(session.run(case)["output"], reference, atol=1e-5)


def test_bad_options(export_model):
    path = export_model(Signature())[0]
    with pytest.raises(OptionError, match="optimization must be one of"):
        MHASession(path, provider="cpu", optimization="max")
    with pytest.raises(ProviderUnavailableError, match="cuda_graph needs provider='cuda'"):
        MHASession(path, provider="cpu", cuda_graph=(1, 8))


# The CUDA side of IO binding and CUDA graphs: tests/runtime/test_cuda.py.


def test_fixed_buffer_replay_path_on_cpu(export_model):
    """The CUDA graph mode's buffers, shape check and lock, driven on CPU (ORT captures no graph there)."""
    from mha_deploy.runtime.session import _CudaGraph

    signature = Signature("cross", "padding")
    session = MHASession(export_model(signature)[0], provider="cpu")
    replay = _CudaGraph(session._session, session.metadata, (2, 5, 7), device="cpu")
    assert replay.feed_shapes["key_padding_mask"] == (2, 7)
    rng = np.random.default_rng(6)
    cases = []
    for _ in range(32):
        case = {name: rng.standard_normal((2, 5 if name == "query" else 7, D), dtype=np.float32)
                for name in ("query", "key", "value")}
        case["key_padding_mask"] = np.arange(7)[None, :] < rng.integers(1, 8, size=2)[:, None]
        cases.append(case)
    expected = [session.run(case)["output"] for case in cases]
    with ThreadPoolExecutor(8) as pool:
        actual = list(pool.map(lambda case: replay.run(case)["output"], cases))
    for want, got in zip(expected, actual, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)
    with pytest.raises(InputError, match="CUDA graph captured for shapes"):
        replay.run({**cases[0], "query": np.zeros((2, 4, D), np.float32)})
    with pytest.raises(InputError, match=r"cuda_graph shape must be \(batch, seq\)"):
        _CudaGraph(session._session, session.metadata, (2, 5), device="cpu")
