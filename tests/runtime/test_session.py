"""MHASession: input validation, model-file errors, providers, and no torch at serving time."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from mha_deploy.errors import InputError, ModelFileError, ProviderUnavailableError
from mha_deploy.metadata import Signature
from mha_deploy.runtime import MHASession
from mha_deploy.runtime.providers import cuda_unavailable_reason
from tests.conftest import TEST_D_MODEL

D = TEST_D_MODEL
rng = np.random.default_rng(0)
ONES = np.ones((2, 5), bool)


def _x(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


@pytest.fixture(scope="module")
def padded_self(export_model):
    return MHASession(export_model(Signature("self", "padding"))[0], provider="cpu")


@pytest.fixture(scope="module")
def padded_cross(export_model):
    return MHASession(export_model(Signature("cross", "padding"))[0], provider="cpu")


SELF_BAD_INPUTS = [
    ({"x": _x(2, 5, D + 1), "key_padding_mask": ONES}, f"x has d_model {D + 1}, this model expects {D}"),
    ({"x": _x(5, D), "key_padding_mask": np.ones((1, 5), bool)}, r"x must have rank 3"),
    ({"x": _x(2, 5, D, dtype=np.float64), "key_padding_mask": ONES}, r"x must be float32, got float64"),
    ({"x": _x(2, 5, D), "key_padding_mask": np.ones((3, 5), bool)}, r"key_padding_mask must have shape .*\(2, 5\)"),
    ({"x": _x(2, 5, D), "key_padding_mask": np.ones((2, 4), bool)}, r"key_padding_mask must have shape .*\(2, 5\)"),
    ({"x": _x(2, 0, D), "key_padding_mask": np.ones((2, 0), bool)}, r"x is empty"),
    ({"x": _x(0, 5, D), "key_padding_mask": np.ones((0, 5), bool)}, r"x is empty"),
    ({"x": _x(2, 5, D)}, r"missing key_padding_mask"),
    ({"x": _x(2, 5, D), "key_padding_mask": ONES, "y": _x(1)}, r"unexpected input 'y'"),
    ({"x": _x(2, 5, D), "key_padding_mask": np.ones((2, 5), np.float32)}, r"key_padding_mask must be bool"),
    ({"x": _x(2, 5, D), "key_padding_mask": np.full((2, 5), 2)}, r"only 0 and 1"),
    ({"x": _x(2, 5, D), "key_padding_mask": np.array([[1, 1, 0, 0, 0], [0] * 5], bool)}, r"rows \[1\] have no real"),
    ({"x": [["a"]], "key_padding_mask": np.ones((1, 1), bool)}, r"x must be float32"),
]


@pytest.mark.parametrize(("inputs", "message"), SELF_BAD_INPUTS)
def test_bad_self_attention_inputs(padded_self, inputs, message):
    with pytest.raises(InputError, match=message):
        padded_self.run(inputs)


CROSS_BAD_INPUTS = [
    ({"query": _x(2, 3, D), "key": _x(3, 4, D), "value": _x(3, 4, D)}, r"batch sizes differ: query 2, key 3, value 3"),
    ({"query": _x(2, 3, D), "key": _x(2, 4, D), "value": _x(2, 6, D)}, r"key and value must have the same length"),
    ({"query": _x(2, 3, D), "key": _x(2, 4, D), "value": _x(2, 4, D)}, r"missing key_padding_mask"),
]


@pytest.mark.parametrize(("inputs", "message"), CROSS_BAD_INPUTS)
def test_bad_cross_attention_inputs(padded_cross, inputs, message):
    if "missing" not in message:
        inputs = {**inputs, "key_padding_mask": np.ones(inputs["key"].shape[:2], bool)}
    with pytest.raises(InputError, match=message):
        padded_cross.run(inputs)


def test_integer_mask_means_the_same_as_bool(padded_self):
    x = _x(2, 6, D)
    mask = np.array([[1, 1, 1, 1, 0, 0], [1] * 6])
    as_int = padded_self.run({"x": x, "key_padding_mask": mask})["output"]
    as_bool = padded_self(x=x, key_padding_mask=mask.astype(bool))["output"]
    np.testing.assert_array_equal(as_int, as_bool)


def test_missing_model(tmp_path):
    with pytest.raises(ModelFileError, match="model file not found"):
        MHASession(tmp_path / "nope.onnx", provider="cpu")


def test_corrupt_model(tmp_path):
    path = tmp_path / "corrupt.onnx"
    path.write_bytes(b"\x08\x07garbage" * 10)
    with pytest.raises(ModelFileError, match="ONNX Runtime cannot load it"):
        MHASession(path, provider="cpu")


def test_model_without_metadata(tmp_path, export_model):
    model = onnx.load(export_model(Signature())[0])
    del model.metadata_props[:]
    path = tmp_path / "plain.onnx"
    onnx.save(model, path)
    with pytest.raises(ModelFileError, match="no mha-deploy metadata"):
        MHASession(path, provider="cpu")


def test_unknown_provider(export_model):
    with pytest.raises(ProviderUnavailableError, match="provider must be one of"):
        MHASession(export_model(Signature())[0], provider="tpu")


@pytest.mark.skipif(cuda_unavailable_reason() is None, reason="CUDA may be usable here; this tests its absence")
def test_cuda_requested_without_cuda_fails_loudly(export_model):
    with pytest.raises(ProviderUnavailableError, match="provider 'cuda' requested but"):
        MHASession(export_model(Signature())[0], provider="cuda")


@pytest.mark.auto_provider
@pytest.mark.skipif(cuda_unavailable_reason() is None, reason="CUDA may be usable here; this tests its absence")
@pytest.mark.parametrize("gpu", [True, False], ids=["gpu-without-cuda-libraries", "no-gpu"])
def test_auto_reports_the_provider_it_got_where_a_gpu_exists(export_model, monkeypatch, gpu):
    """Why ``auto`` took the CPU is worth a note on a machine with a GPU; on one without, it would only puzzle."""
    from mha_deploy.runtime import providers

    monkeypatch.setattr(providers, "gpu_present", lambda: gpu)
    session = MHASession(export_model(Signature())[0], provider="auto")
    assert session.provider == "cpu"
    assert session.provider_note.startswith("using CPU") if gpu else session.provider_note == ""


def test_serving_runs_without_torch(export_model):
    """A service embedding the session must work where torch is not installed."""
    path, _ = export_model(Signature("self", "padding-causal"))
    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # any 'import torch' now raises ImportError
        sys.modules["onnxscript"] = None
        import numpy as np
        from mha_deploy.batch import BatchRunner
        from mha_deploy.runtime import MHASession
        session = MHASession({str(path)!r}, provider="cpu")
        x = np.ones((1, 4, {D}), np.float32)
        out = session.run({{"x": x, "key_padding_mask": np.ones((1, 4), bool)}})["output"]
        print(out.shape)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"(1, 4, {D})"


# --- KV cache ------------------------------------------------------------------------------------

H, D_K = 4, D // 4
PAST = np.zeros((2, H, 3, D_K), np.float32)


@pytest.fixture(scope="module")
def kv_session(export_model):
    return MHASession(export_model(Signature("self", "padding-causal", kv_cache=True))[0], provider="cpu")


@pytest.mark.parametrize(
    ("feeds", "message"),
    [
        ({"past_key": np.zeros((2, H + 1, 3, D_K), np.float32)}, r"past_key must have shape \[batch, heads"),
        ({"past_value": np.zeros((2, H, 3, D_K), np.float64)}, "past_value must be float32"),
        ({"past_value": np.zeros((2, H, 4, D_K), np.float32)}, "past_seq differs"),
        ({"past_key": np.zeros((1, H, 3, D_K), np.float32)}, r"\[2, 4, past_seq, 16\]"),
        ({"key_padding_mask": np.ones((2, 2), bool)}, r"key_padding_mask must have shape \[batch, kv_len\] = \(2, 5\)"),
        ({"past_key": None}, "missing past_key"),
    ],
)
def test_kv_cache_inputs_are_checked(kv_session, feeds, message):
    good = {"x": _x(2, 2, D), "past_key": PAST, "past_value": PAST, "key_padding_mask": ONES}
    inputs = {k: v for k, v in {**good, **feeds}.items() if v is not None}
    with pytest.raises(InputError, match=message):
        kv_session.run(inputs)


def test_kv_cache_model_runs_prefill_and_decode(kv_session):
    empty = np.zeros((2, H, 0, D_K), np.float32)
    prefill = kv_session.run({"x": _x(2, 3, D), "past_key": empty, "past_value": empty,
                              "key_padding_mask": np.ones((2, 3), bool)})
    assert prefill["present_key"].shape == (2, H, 3, D_K)
    step = kv_session.run({"x": _x(2, 1, D), "past_key": prefill["present_key"],
                           "past_value": prefill["present_value"], "key_padding_mask": np.ones((2, 4), bool)})
    assert step["output"].shape == (2, 1, D) and step["present_value"].shape == (2, H, 4, D_K)


def test_a_cache_that_does_not_concatenate_is_refused(kv_session):
    """check_cache_behaviour: a graph whose present drops the past is not the cache its metadata declares."""
    from mha_deploy.runtime.model_check import check_cache_behaviour

    def forgetful(feeds):
        outputs = kv_session._session.run(None, feeds)
        result = dict(zip(kv_session.output_names, outputs, strict=True))
        new = feeds["x"].shape[1]
        return {**result, "present_key": result["present_key"][:, :, -new:]}

    check_cache_behaviour(lambda f: dict(zip(kv_session.output_names, kv_session._session.run(None, f), strict=True)),
                          kv_session.metadata, "kv.onnx")
    with pytest.raises(ModelFileError, match=r"present_key differs.*not the KV cache"):
        check_cache_behaviour(forgetful, kv_session.metadata, "kv.onnx")



# --- run_in_place through a binding kept across calls (session.KeptBinding) ---------------------------------------


def _accumulator() -> ort.InferenceSession:
    """cache_out = cache + x (written into the cache in place by run_in_place), y = x * 2: a KV cache's step in
    miniature."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Add", ["cache", "x"], ["cache_out"]), helper.make_node("Add", ["x", "x"], ["y"])]
    graph = helper.make_graph(
        nodes, "accumulator",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["n", 4]) for name in ("cache", "x")],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["n", 4]) for name in ("cache_out", "y")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_a_kept_binding_rebinds_what_moved_and_reads_what_changed_in_place():
    """Across calls of one binding: an array changed in place is read as it is now, a new array (another address or
    shape) is bound anew, and every call's outputs equal a fresh binding's (exactly)."""
    from mha_deploy.runtime.session import KeptBinding, run_in_place

    session = _accumulator()
    kept = KeptBinding(session)
    rng = np.random.default_rng(0)
    cache = np.zeros((2, 4), np.float32)
    for call in range(6):
        if call == 3:
            cache = np.concatenate([cache, np.ones((1, 4), np.float32)])  # the buffer grows: a new array
        x = rng.standard_normal(cache.shape).astype(np.float32)  # a new array every call
        expected_cache, expected_y = cache + x, x * 2
        out = run_in_place(session, {"cache": cache, "x": x}, {"cache_out": "cache"}, ("y",), kept)
        np.testing.assert_array_equal(out["y"], expected_y)
        np.testing.assert_array_equal(cache, expected_cache)  # written in place, into the array bound now
        fresh = cache.copy()
        again = run_in_place(session, {"cache": fresh, "x": x}, {"cache_out": "cache"}, ("y",))
        np.testing.assert_array_equal(again["y"], out["y"])


def test_a_kept_binding_writes_outputs_into_the_callers_arrays_and_goes_back_to_allocated_ones():
    """An output given in ``into`` is written into the caller's array (returned as it is); asked for as ``wanted``
    on a later call, ORT allocates it and the caller's array stays as it was; given again as the same array, it is
    bound again (exactly a fresh binding's values each time)."""
    from mha_deploy.runtime.session import KeptBinding, run_in_place

    session = _accumulator()
    kept = KeptBinding(session)
    rng = np.random.default_rng(1)
    cache, mine = np.zeros((2, 4), np.float32), np.empty((2, 4), np.float32)
    for call, into in enumerate([True, False, True, True, False]):
        x = rng.standard_normal(cache.shape).astype(np.float32)
        before = mine.copy()
        out = run_in_place(session, {"cache": cache, "x": x}, {"cache_out": "cache"}, () if into else ("y",), kept,
                           {"y": mine} if into else None)
        np.testing.assert_array_equal(out["y"], x * 2)
        assert (out["y"] is mine) == into, call
        if not into:
            np.testing.assert_array_equal(mine, before)  # ORT wrote elsewhere
