"""The v2 protocol core in-process: a batch request split into items, batched, and put back exactly."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from mha_deploy.batching import BatchingConfig
from mha_deploy.metadata import Signature
from mha_deploy.runtime import MHASession
from mha_deploy.serving.http import v2
from mha_deploy.serving.http.batcher import MicroBatcher
from mha_deploy.serving.http.parsing import RequestError
from mha_deploy.serving.http.rest_v2 import parse_infer_request
from tests.conftest import TEST_D_MODEL
from tests.serving.helpers import assert_matches, batch_request

D = TEST_D_MODEL
SIGNATURES = [Signature("self", "padding"), Signature("cross", "padding", return_weights=True),
              Signature("self", "padding-causal"), Signature("self", "causal")]


@pytest.fixture(scope="module")
def sessions(export_model):
    return {signature: MHASession(export_model(signature)[0], provider="cpu") for signature in SIGNATURES}


def run_requests(session: MHASession, requests: list[dict[str, np.ndarray]], **batcher_options):
    """All requests at once through one batcher, as concurrent clients would send them."""
    async def main():
        batcher = MicroBatcher(session, BatchingConfig(max_wait_ms=20, **batcher_options))
        await batcher.start()
        try:
            plans = [v2.plan_request(session.metadata, inputs, max_item_tokens=1024) for inputs in requests]
            outputs = await asyncio.gather(*(v2.run_plan(plan, batcher, session.metadata) for plan in plans))
            runs = batcher.metrics.registry.get_sample_value("mha_batch_size_count")
        finally:
            await batcher.stop()
        return plans, outputs, runs

    return asyncio.run(main())


@pytest.mark.parametrize("signature", SIGNATURES, ids=lambda s: f"{s.attention}-{s.mask}")
def test_requests_of_any_padding_equal_the_session(sessions, signature):
    session = sessions[signature]
    rng = np.random.default_rng(0)
    paddings = ["right", "left", "mixed", "right"] if signature.has_padding_mask else ["right"] * 4
    requests = []
    for padding in paddings:
        lengths = [int(n) for n in rng.integers(1, 12, size=3)]
        if not signature.has_padding_mask:
            lengths = [lengths[0]] * 3  # a request without a mask holds rows of one length
        kv = [int(n) for n in rng.integers(1, 12, size=3)]
        requests.append(batch_request(signature, rng, 3, lengths, D, padding, kv_lengths=kv))
    plans, outputs, runs = run_requests(session, requests)
    for plan, padding in zip(plans, paddings, strict=True):
        assert plan.right_padded == (padding == "right" or not signature.has_padding_mask)
    for inputs, result in zip(requests, outputs, strict=True):
        assert_matches(session, inputs, result)
    assert runs < sum(len(p.items) for p in plans if p.right_padded) + sum(not p.right_padded for p in plans), (
        "rows of different requests share runs")


def test_left_padded_requests_run_in_runs_within_the_token_budget(sessions):
    session = sessions[Signature("self", "padding")]
    rng = np.random.default_rng(1)
    inputs = batch_request(session.signature, rng, 7, [9, 3, 9, 1, 5, 9, 2], D, "left")
    _, (outputs,), runs = run_requests(session, [inputs], max_batch_tokens=20)
    assert runs == 4  # 2 rows of 9 positions per run
    assert_matches(session, inputs, outputs)


def test_values_at_padded_positions_do_not_matter(sessions):
    """Whatever a client puts at padding (even NaN) cannot reach a real position: it is never read, or zeroed."""
    session = sessions[Signature("self", "padding")]
    rng = np.random.default_rng(2)
    for padding in ("right", "left"):
        inputs = batch_request(session.signature, rng, 2, [4, 6], D, padding)
        dirty = {**inputs, "x": np.where(inputs["key_padding_mask"][..., None], inputs["x"], np.nan)}
        _, (outputs,), _ = run_requests(session, [dirty])
        assert_matches(session, inputs | {"x": np.where(inputs["key_padding_mask"][..., None], inputs["x"], 0)},
                       outputs)


def test_rows_over_the_queue_and_bad_rows_are_refused(sessions):
    session = sessions[Signature("self", "padding")]
    inputs = batch_request(session.signature, np.random.default_rng(3), 5, [2] * 5, D)
    with pytest.raises(RequestError) as info:
        run_requests(session, [inputs], max_queue=4)
    assert (info.value.status, info.value.kind) == (400, "too_many_rows")
    inputs["x"][3, 1, 0] = np.inf
    with pytest.raises(RequestError) as info:
        v2.plan_request(session.metadata, inputs, max_item_tokens=1024)
    assert info.value.status == 400 and info.value.message.startswith("row 3: x contains NaN or Inf")


def _body(tensors: list[dict], raw: bytes = b"") -> tuple[bytes, str | None]:
    header = json.dumps({"inputs": tensors}).encode()
    return header + raw, str(len(header)) if raw else None


@pytest.mark.parametrize(
    ("tensors", "raw", "message"),
    [
        ([{"name": "x", "shape": [1, 1, D], "datatype": "FP32", "parameters": {"binary_data_size": 4 * D}},
          {"name": "key_padding_mask", "shape": [1, 1], "datatype": "BOOL", "parameters": {"binary_data_size": 1}}],
         np.ones(D, np.float32).tobytes() + b"\x02", "BOOL data must be bytes 0 or 1"),
        ([{"name": "x", "shape": [1, 1, D], "datatype": "FP32", "data": [1.0] * D},
          {"name": "x", "shape": [1, 1, D], "datatype": "FP32", "data": [1.0] * D}], b"", "given twice"),
        ([{"name": "x", "shape": [1, 1, D], "datatype": "FP32", "parameters": {"binary_data_size": 4 * D + 4}}],
         np.ones(D + 1, np.float32).tobytes(), f"needs {4 * D}"),
        ([{"name": "x", "shape": [1, -1, D], "datatype": "FP32", "data": []}], b"", "non-negative integers"),
        ([{"name": "x", "shape": [0, 1, D], "datatype": "FP32", "data": []}], b"", "empty batch"),
        ([{"name": "x", "shape": [1, 1, D], "datatype": "FP32", "data": [[1.0] * D, [1.0]]}], b"", "ragged"),
        ([{"name": "key_padding_mask", "shape": [1, 1], "datatype": "BOOL", "data": [1]}], b"", "true/false"),
    ],
    ids=["bool-byte-2", "duplicate", "binary-size", "negative-dim", "empty-batch", "ragged", "bool-as-int"],
)
def test_request_bodies_the_parser_refuses(sessions, tensors, raw, message):
    metadata = sessions[Signature("self", "padding")].metadata
    body, header_length = _body(tensors, raw)
    with pytest.raises(RequestError) as info:
        parse_infer_request(body, header_length, metadata, max_item_tokens=1024)
    assert info.value.status == 400 and message in info.value.message, info.value.message


def test_grpc_request_decoding(sessions):
    pytest.importorskip("tritonclient.grpc")
    from tritonclient.grpc import service_pb2 as pb

    from mha_deploy.serving.http.grpc_server import decode_request

    metadata = sessions[Signature("self", "padding")].metadata
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 2, D])
    request.raw_input_contents.extend([b"\0" * (8 * D), b"\1\1"])
    with pytest.raises(RequestError, match="2 raw_input_contents for 1 inputs"):
        decode_request(request, metadata, 1024)
    del request.raw_input_contents[1]
    inputs, outputs = decode_request(request, metadata, 1024)
    assert inputs["x"].shape == (1, 2, D) and outputs == ["output"]
    request.outputs.add(name="nope")
    with pytest.raises(RequestError, match="unknown output 'nope'"):
        decode_request(request, metadata, 1024)


def test_grpc_shutdown_does_not_wait_for_calls_still_receiving_their_message():
    """After the receive timeout only calls the servicer is answering hold the stop; the rest are cancelled."""
    pytest.importorskip("tritonclient.grpc")
    import time

    from mha_deploy.serving.http.grpc_server import GrpcConfig, GrpcFrontend

    class StalledServer:
        """Stands in for a grpc.aio server with a call whose message never completes."""

        def __init__(self):
            self.cancelled = asyncio.Event()
            self.graces = []

        async def stop(self, grace):
            self.graces.append(grace)
            if grace is None:
                self.cancelled.set()
            await self.cancelled.wait()

    async def main(in_flight_for: float) -> tuple[float, list]:
        frontend = GrpcFrontend(None, GrpcConfig(grace_s=30, receive_timeout_s=0.2))
        frontend._server = StalledServer()
        frontend.servicer = type("Servicer", (), {"in_flight": 1})()
        asyncio.get_running_loop().call_later(in_flight_for, setattr, frontend.servicer, "in_flight", 0)
        start = time.monotonic()
        await frontend.stop()
        return time.monotonic() - start, frontend._server.graces

    elapsed, graces = asyncio.run(main(in_flight_for=0.5))
    assert 0.45 < elapsed < 2 and graces == [30, None]  # waited for the answered call, not for the 30 s grace
    elapsed, graces = asyncio.run(main(in_flight_for=0.0))
    assert 0.15 < elapsed < 1 and graces == [30, None]
