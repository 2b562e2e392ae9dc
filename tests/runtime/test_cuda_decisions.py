"""What the CUDA path decides before ORT runs anything, exercised on the CPU.

Provider options (TF32 off), loading CUDA from pip wheels, naming a missing
cuDNN, refusing models the CUDA provider cannot run (MHASession and Triton's
``--kind gpu``), and one thread for every CUDA graph run. The GPU side of each
is in ``test_cuda.py``.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from mha_deploy.errors import ProviderUnavailableError
from mha_deploy.metadata import Signature
from mha_deploy.runtime import MHASession, providers
from mha_deploy.runtime.cuda_support import RAGGED_OFF_CPU, cuda_graph_unsupported, cuda_unsupported
from mha_deploy.runtime.providers import CPU_EP, CUDA_EP, ProviderPlan
from mha_deploy.serving.triton import TritonConfig, TritonExportError, write_triton_model
from tests.conftest import TEST_D_MODEL, TEST_HEADS

D = TEST_D_MODEL
PADDING = Signature("self", "padding")
WEIGHTS = Signature("self", "padding", return_weights=True)


@pytest.fixture(scope="module")
def int8_model(tmp_path_factory):
    import torch

    from mha_deploy.exporters import export_mha
    from mha_deploy.models import MultiHeadAttention

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("int8") / "int8.onnx"
    export_mha(MultiHeadAttention(D, TEST_HEADS).eval(), path, PADDING, quantize="int8-dynamic")
    return path


# --- provider options and libraries -------------------------------------------------------------


def test_cuda_sessions_get_tf32_off_and_extra_options():
    plan = ProviderPlan("cuda", (CUDA_EP, CPU_EP))
    assert plan.session_providers() == [(CUDA_EP, {"use_tf32": "0"}), CPU_EP]
    assert plan.session_providers(enable_cuda_graph="1") == [
        (CUDA_EP, {"use_tf32": "0", "enable_cuda_graph": "1"}), CPU_EP,
    ]
    assert ProviderPlan("cpu", (CPU_EP,)).session_providers() == [CPU_EP]


def test_cuda_libraries_are_preloaded_once_and_quietly(monkeypatch, capsys):
    calls = []

    def preload(**kwargs):
        calls.append(kwargs)
        print("Failed to load libcublasLt.so.13")  # what ORT's preload_dlls prints on stdout

    monkeypatch.setattr(ort, "preload_dlls", preload, raising=False)
    providers.preload_cuda_libraries.cache_clear()
    try:
        providers.cuda_unavailable_reason()
        providers.cuda_unavailable_reason()
    finally:
        providers.preload_cuda_libraries.cache_clear()
    assert calls == [{}]
    assert capsys.readouterr().out == "", "stdout may carry --json: preload_dlls' chatter must not reach it"


def test_an_onnxruntime_without_preload_dlls_is_fine(monkeypatch):
    monkeypatch.delattr(ort, "preload_dlls", raising=False)
    providers.preload_cuda_libraries.cache_clear()
    try:
        providers.preload_cuda_libraries()
    finally:
        providers.preload_cuda_libraries.cache_clear()


def test_a_missing_cudnn_is_named(monkeypatch):
    """cuDNN is loaded lazily by ORT, so the provider library loads without it: it is looked for by name."""
    monkeypatch.setattr(ort, "get_available_providers", lambda: [CUDA_EP, CPU_EP])
    monkeypatch.setattr(providers.os.path, "exists", lambda path: True)
    monkeypatch.setattr(providers, "preload_cuda_libraries", lambda: None)
    monkeypatch.setattr(
        providers, "_missing_library",
        lambda library: f"{library}: cannot open shared object file" if library == "libcudnn.so.9" else None,
    )
    reason = providers.cuda_unavailable_reason()
    assert reason is not None and reason.startswith("cuDNN 9 is missing (libcudnn.so.9") and "[cuda,cudnn]" in reason


# --- models the CUDA provider cannot run ---------------------------------------------------------


def test_cuda_unsupported_names_int8_and_returned_weights(export_model, int8_model):
    assert cuda_unsupported(onnx.load(export_model(PADDING)[0])) is None
    assert cuda_unsupported(onnx.load(export_model(PADDING, dtype="fp16")[0])) is None
    assert "int8-dynamic (DynamicQuantizeLinear, MatMulInteger)" in cuda_unsupported(onnx.load(int8_model))
    assert "qk_matmul_output" in cuda_unsupported(onnx.load(export_model(WEIGHTS)[0]))
    # Unfused, the weights are a plain Softmax output: every op has a CUDA kernel.
    assert cuda_unsupported(onnx.load(export_model(WEIGHTS, "none")[0])) is None


def test_cuda_unsupported_names_fp32_group_query_attention(export_model):
    """Causal --fuse mha is GroupQueryAttention, which CUDA runs in fp16/bf16 only."""
    causal = Signature("self", "causal")
    assert "GroupQueryAttention" in cuda_unsupported(onnx.load(export_model(causal)[0]))
    assert cuda_unsupported(onnx.load(export_model(causal, dtype="fp16")[0])) is None
    assert cuda_unsupported(onnx.load(export_model(causal, "onnx")[0])) is None


def test_cuda_graphs_refuse_control_flow(export_model):
    """--fuse mha/auto puts a padding mask and, in fp32, GroupQueryAttention's choice of path and the mask-free op's
    choice of kernel by length behind an If; a CUDA graph cannot hold one."""
    assert "If" in cuda_graph_unsupported(onnx.load(export_model(PADDING, dtype="fp16")[0]))
    # fp16 causal is GroupQueryAttention with no If (the form CUDA's kernel runs), refused for its host-side lengths.
    assert "GroupQueryAttention" in cuda_graph_unsupported(
        onnx.load(export_model(Signature("self", "causal"), dtype="fp16")[0]))
    assert cuda_graph_unsupported(onnx.load(export_model(PADDING, "onnx", dtype="fp16")[0])) is None
    mask_free = Signature("self", "none")
    assert "If" in cuda_graph_unsupported(onnx.load(export_model(mask_free)[0]))
    # fp16 is the CUDA export: its mask-free attention is the flash op alone.
    assert cuda_graph_unsupported(onnx.load(export_model(mask_free, dtype="fp16")[0])) is None


@pytest.fixture
def cuda_looks_usable(monkeypatch):
    """The provider plan as on a GPU host: CUDA first. (ORT itself still falls back here; no session gets that far.)"""
    monkeypatch.setattr(providers, "cuda_unavailable_reason", lambda: None)
    monkeypatch.setattr(providers, "gpu_present", lambda: True)


def test_cuda_refuses_an_int8_model_before_ort_sees_it(int8_model, cuda_looks_usable):
    with pytest.raises(ProviderUnavailableError, match=r"requested but .*int8\.onnx: the model is int8"):
        MHASession(int8_model, provider="cuda")


@pytest.mark.auto_provider
def test_auto_runs_a_weights_model_on_the_cpu_with_a_note(export_model, cuda_looks_usable):
    session = MHASession(export_model(WEIGHTS)[0], provider="auto")
    assert session.provider == "cpu"
    assert session.provider_note.startswith("using CPU: ") and "qk_matmul_output" in session.provider_note


def test_cuda_graph_on_an_int8_model_is_refused_by_name(int8_model, cuda_looks_usable):
    """Instead of ORT's failure to capture a graph across CPU-placed nodes."""
    with pytest.raises(ProviderUnavailableError, match="the model is int8"):
        MHASession(int8_model, provider="cuda", cuda_graph=(1, 8))


def test_cuda_graph_on_a_model_with_an_if_is_refused_by_name(export_model, cuda_looks_usable):
    with pytest.raises(ProviderUnavailableError, match="cannot capture in a CUDA graph; export it with --fuse onnx"):
        MHASession(export_model(PADDING, dtype="fp16")[0], provider="cuda", cuda_graph=(1, 8))


def test_triton_kind_gpu_refuses_what_cuda_cannot_run(tmp_path, export_model, int8_model):
    with pytest.raises(TritonExportError, match=r"--kind gpu: .*the model is int8"):
        write_triton_model(int8_model, tmp_path / "repo", TritonConfig(kind="gpu"))
    with pytest.raises(TritonExportError, match=r"--kind gpu: .*qk_matmul_output"):
        write_triton_model(export_model(WEIGHTS)[0], tmp_path / "repo", TritonConfig(kind="gpu"))
    assert not (tmp_path / "repo").exists() or not any((tmp_path / "repo").iterdir())
    write_triton_model(int8_model, tmp_path / "repo", TritonConfig(kind="cpu"))  # the CPU is where it runs
    write_triton_model(export_model(PADDING, dtype="fp16")[0], tmp_path / "repo", TritonConfig(kind="gpu"))


# --- CUDA graph: one thread for every run ---------------------------------------------------------


class _ThreadRecorder:
    """An InferenceSession that notes which thread each IO-binding run comes from."""

    def __init__(self, session: ort.InferenceSession):
        self._session = session
        self.threads: list[int] = []

    def run_with_iobinding(self, binding, *args):
        self.threads.append(threading.get_ident())
        return self._session.run_with_iobinding(binding, *args)

    def __getattr__(self, name):
        return getattr(self._session, name)


def test_cuda_graph_capture_and_every_replay_share_one_thread(export_model):
    """ORT keeps a CUDA graph per thread: runs from other threads would capture (and keep) one each."""
    from mha_deploy.runtime.session import _CudaGraph

    session = MHASession(export_model(PADDING)[0], provider="cpu")
    recorder = _ThreadRecorder(session._session)
    replay = _CudaGraph(recorder, session.metadata, (2, 8), device="cpu")
    rng = np.random.default_rng(1)
    cases = [
        {"x": rng.standard_normal((2, 8, D), dtype=np.float32), "key_padding_mask": np.ones((2, 8), bool)}
        for _ in range(24)
    ]
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(replay.run, cases))
    assert len(recorder.threads) == 2 + len(cases)  # warm-up and capture on load, then one run per call
    assert len(set(recorder.threads)) == 1 and recorder.threads[0] != threading.get_ident()


def test_cuda_graphs_refuse_token_packing():
    """A packed model's shapes follow its padding (NonZero), which a CUDA graph cannot replay."""
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("NonZero", ["mask"], ["real"])], "packed",
        [onnx.helper.make_tensor_value_info("mask", onnx.TensorProto.BOOL, ["batch", "seq"])],
        [onnx.helper.make_tensor_value_info("real", onnx.TensorProto.INT64, [2, "tokens"])],
    )
    reason = cuda_graph_unsupported(onnx.helper.make_model(graph))
    assert "packs its tokens" in reason and "--no-pack-tokens" in reason


# --- a ragged KV-cache file (export --kv-cache's default) off the CPU: refused with what to do instead ---


def test_cuda_unsupported_names_a_ragged_cache_and_the_holes_export(lm_cache):
    """fp32 GroupQueryAttention has no CUDA kernel: a ragged file is told to export --cache-layout holes, whose
    contrib MultiHeadAttention CUDA runs."""
    ragged, holes = lm_cache("causal_lm")[0], lm_cache("causal_lm", "--cache-layout", "holes")[0]
    assert "--cache-layout holes" in cuda_unsupported(onnx.load(ragged))
    assert cuda_unsupported(onnx.load(holes)) is None


def test_a_ragged_file_without_its_metadata_is_read_off_its_graph(lm_cache):
    """Metadata stripped (a copy another tool rewrote): the GroupQueryAttention reading past_key_values still says
    ragged, as it does to the stepper; the holes file's attention (contrib MultiHeadAttention) still runs on CUDA."""
    ragged, holes = (onnx.load(lm_cache("causal_lm", *flags)[0]) for flags in ((), ("--cache-layout", "holes")))
    for proto in (ragged, holes):
        del proto.metadata_props[:]
    assert cuda_unsupported(ragged) == RAGGED_OFF_CPU
    assert cuda_unsupported(holes) is None


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_generate_and_serve_on_cuda_refuse_a_ragged_file_in_one_line(lm_cache, cuda_looks_usable, tmp_path, command):
    from click.testing import CliRunner

    from mha_deploy.cli import main
    from tests.serving.helpers import free_port

    path = lm_cache("causal_lm")[0]
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"id": "a", "input_ids": [1, 2]}\n')
    args = (["generate", str(path), "--input", str(prompts), "--output", str(tmp_path / "out.jsonl")]
            if command == "generate" else ["serve", str(path), "--port", str(free_port())])
    result = CliRunner().invoke(main, [*args, "--provider", "cuda"])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: provider 'cuda' requested but ") and "ragged KV cache" in lines[-1], lines
    assert "--provider cpu" in lines[-1] and "--cache-layout holes" in lines[-1]
    assert "Traceback" not in result.output


def test_the_stepper_refuses_a_ragged_file_on_another_provider(lm_cache, monkeypatch):
    """What an fp16 ragged file on CUDA meets (its session would open): the stepper's cache is host memory ORT
    writes in place."""
    from mha_deploy.errors import OptionError
    from mha_deploy.runtime import kv_stepper

    monkeypatch.setattr(kv_stepper, "_provider", lambda session: "cuda")
    with pytest.raises(OptionError, match=r"provider 'cuda': .*CPU provider only.*--cache-layout holes for CUDA"):
        kv_stepper.KVCacheStepper(lm_cache("causal_lm")[0])
