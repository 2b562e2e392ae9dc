"""Shared fixtures: exported models are cached for the whole session (an export costs 1-3 s)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from mha_deploy.metadata import ATTENTION_KINDS, MASK_MODES, Signature

TEST_D_MODEL, TEST_HEADS = 64, 4

# Every valid (attention, mask) pair: causal needs self-attention.
SIGNATURES = [
    Signature(attention, mask)
    for attention in ATTENTION_KINDS
    for mask in MASK_MODES
    if not (attention == "cross" and "causal" in mask)
]


# A 2-layer KV-cache decoder stack: what `export --model decoder --layers 2 --mask padding --kv-cache` writes.
KV_DECODER = Signature("cross", "padding", model="decoder", kv_cache=True, layers=2)


def names_listed(text: str, role: str) -> list[str]:
    """The checkpoint names ``text`` (a help text or an error) lists for ``role`` ("query" ... "output"), written
    ``role: a, b, c`` as ``mha_deploy.checkpoint_names`` words it; line wrapping ignored."""
    found = re.search(rf"\b{role}: ([^;(]+)", " ".join(text.split()))
    return found.group(1).strip().removesuffix(".").split(", ") if found else []


def randomise_parameters(module, seed: int):
    """``module`` in eval mode with every parameter drawn afresh (std 0.1, near torch's initial scale): torch
    starts biases at zero, which would hide a wrong q/k/v split or a dropped bias, and clones one layer's
    initial weights into every layer of a stack, which would hide taking the wrong layer."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=gen) * 0.1)
    return module.eval()


def exported_once(tmp_path_factory, key: tuple, export: Callable[[Path], dict]) -> tuple[Path, dict]:
    """``(folder, record)``: ``export(folder)`` run once per test run for ``key``, the JSON-able record it returned
    (what the fixture needs besides the files it wrote in ``folder``).

    Under xdist (scripts/test.sh) each worker is its own session, and the session fixtures below would export a model
    once per worker that runs a file using it; the same code with the same arguments writes the same file, so the
    first worker to need ``key`` exports it under a lock in the folder both workers' basetemps share, and the other
    waits for it and reads it. One process alone keeps the folder in its own basetemp.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: one export per worker, as without the shared folder
        fcntl = None
    base = tmp_path_factory.getbasetemp()
    shared = fcntl is not None and os.environ.get("PYTEST_XDIST_WORKER") is not None
    root = (base.parent if shared else base) / "exported-once"
    folder = root / hashlib.sha256(repr(key).encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    record = folder / "record.json"
    with open(folder / "lock", "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if not record.exists():  # an export that raised wrote no record: the next one to ask tries again
            record.write_text(json.dumps(export(folder)))
        return folder, json.loads(record.read_text())


def _trace_inputs_digest(module) -> str:
    """What a trace of ``module`` depends on beyond its code: its weights and buffers, its config (a Hugging Face
    model's), and a declared wrapper's mask dtypes and binding (own_model.DeclaredModule)."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(name.encode())
        digest.update(repr((tensor.dtype, tuple(tensor.shape))).encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    configs = [repr(sub.config) for sub in module.modules() if hasattr(sub, "config")][:1]
    extra = (getattr(module, "mask_dtypes", None), getattr(module, "binding", None), configs)
    digest.update(repr(extra).encode())
    return digest.hexdigest()


@contextlib.contextmanager
def traces_shared(tmp_path_factory, file: str, factory: str):
    """Within it, ``export_model``'s trace (torch.onnx.export of the declared module: most of an export's time,
    15-30 s for an encoder-decoder here) of tests/user_models/<file>.py's ``factory`` runs once per test run; yields
    the tracing function, for tests that trace the plain graph themselves.

    The default export, the packed one, the --kv-cache ones and the fusion tests' plain graph of one model all
    start from the same trace: packing, the cache and fusion are rewrites of the graph it returns, which every
    caller still runs. The key holds every argument of the trace and the module's weights, config and declared
    mask dtypes, so a test that changes the module (scaled weights) or the call (another max length) traces anew;
    the trace itself stays tested by whichever test asks first.
    """
    import inspect

    import onnx

    from mha_deploy.exporters import export as export_module
    from mha_deploy.exporters import torch_export

    real = torch_export.export_onnx
    parameters = inspect.signature(real)

    def trace(*args, **kwargs) -> onnx.ModelProto:
        bound = parameters.bind(*args, **kwargs)
        bound.apply_defaults()
        module = bound.arguments.pop("module")
        key = ("trace", file, factory, _trace_inputs_digest(module), repr(sorted(bound.arguments.items())))

        def write(folder: Path) -> dict:
            onnx.save(real(*args, **kwargs), folder / "plain.onnx")
            return {}

        folder, _ = exported_once(tmp_path_factory, key, write)
        return onnx.load(str(folder / "plain.onnx"))

    saved = export_module.export_onnx
    export_module.export_onnx = trace
    try:
        yield trace
    finally:
        export_module.export_onnx = saved


@pytest.fixture(scope="session")
def shared_trace(tmp_path_factory):
    """``with shared_trace(file, factory): export_model(...)``: conftest.traces_shared, for tests that export
    tests/user_models/<file>.py's ``factory()`` themselves (unchanged: the key reads weights and config, not code)."""
    return functools.partial(traces_shared, tmp_path_factory)


def parameter_sum(module) -> float:
    """The sum of every parameter of ``module``: a worker that rebuilds a seeded module beside a file another worker
    exported checks with it that it built the same weights."""
    return float(sum(parameter.detach().double().sum() for parameter in module.parameters()))


def signature_id(signature: Signature) -> str:
    prefix = f"{signature.model}-" if signature.model != "mha" else f"{signature.attention}-"
    return prefix + signature.mask + ("-weights" if signature.return_weights else "") + (
        "-kv-cache" if signature.kv_cache else ""
    )


has_torch = importlib.util.find_spec("torch") is not None


# What users get: the default (auto: contrib MultiHeadAttention, or ONNX Attention when returning
# weights), the other fused target, and the plain graph.
USER_TARGETS = ("auto", "onnx", "none")


@pytest.fixture(scope="session")
def export_model(tmp_path_factory):
    """``export_model(signature, fuse, dtype) -> (path, reference torch module)``, exported once per arguments.

    ``fuse`` defaults to "auto", what ``mha-deploy export`` writes unless told otherwise;
    ``dtype`` to "fp32" (the reference module stays fp32 either way). A stack's signature
    (``KV_DECODER``) exports a seeded stack of ``signature.layers`` layers; its reference is
    the cache-free stack graph: one forward over the whole sequence.
    """
    cache = {}

    def export(signature: Signature, fuse: str = "auto", dtype: str = "fp32"):
        if (signature, fuse, dtype) not in cache:
            import torch

            from mha_deploy.exporters import export_mha
            from mha_deploy.exporters.graphs import attention_graph
            from mha_deploy.models import MultiHeadAttention

            # Built from the seed in every worker (the reference module), exported once per run (exported_once).
            torch.manual_seed(1234)
            name = f"{signature_id(signature)}-{fuse}-{dtype}.onnx"
            if signature.model != "mha":
                from mha_deploy.exporters import export_stack
                from mha_deploy.exporters.stack_graphs import stack_graph
                from mha_deploy.models import Decoder, Encoder

                stack_type = Decoder if signature.model == "decoder" else Encoder
                module = stack_type(signature.layers, TEST_D_MODEL, TEST_HEADS, 2 * TEST_D_MODEL).eval()

                def reference():
                    return stack_graph(module, signature.mask)

                def write(folder: Path) -> dict:
                    export_stack(module, folder / name, signature.mask, signature.kv_cache, fuse=fuse, dtype=dtype)
                    return {"parameter_sum": parameter_sum(module)}
            else:
                module = MultiHeadAttention(TEST_D_MODEL, TEST_HEADS).eval()

                def reference():
                    return attention_graph(module, signature)

                def write(folder: Path) -> dict:
                    export_mha(module, folder / name, signature, fuse=fuse, dtype=dtype)
                    return {"parameter_sum": parameter_sum(module)}

            folder, record = exported_once(tmp_path_factory, ("export_model", repr(signature), fuse, dtype), write)
            assert record["parameter_sum"] == parameter_sum(module), "the seed built other weights in this worker"
            cache[signature, fuse, dtype] = (folder / name, reference())
        return cache[signature, fuse, dtype]

    return export


@pytest.fixture
def defective_export(monkeypatch):
    """Make every export produce a subtly wrong graph: the output projection's bias off by 1e-3.

    Far smaller than any mask or head-split bug, and larger than the default
    tolerance: what parity at export must refuse.
    """
    import onnx

    from mha_deploy.exporters import export as export_module

    real_export = export_module.export_onnx

    def export_with_defect(*args, **kwargs):
        model = real_export(*args, **kwargs)
        biases = [t for t in model.graph.initializer if "W_o" in t.name and t.name.endswith("bias")]
        assert biases, [t.name for t in model.graph.initializer]
        for tensor in biases:
            tensor.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(tensor) + 1e-3, tensor.name))
        return model

    monkeypatch.setattr(export_module, "export_onnx", export_with_defect)


def pytest_configure(config):
    config.addinivalue_line("markers", "auto_provider: tests provider 'auto' itself (exempt from the pinning check)")
    # Two xdist workers on two cores: torch's intra-op threads of one worker wait on each other while the other
    # worker holds a core (one Marian export from its trace, on a busy machine: 35 s at two threads, 13-18 s at one).
    # One thread per worker; tests that measure threads set their own.
    if os.environ.get("PYTEST_XDIST_WORKER") and importlib.util.find_spec("torch") is not None:
        import torch

        torch.set_num_threads(1)
    # Tests that call torch.onnx.export themselves share the exporter's once-made torchlib list too.
    if importlib.util.find_spec("torch") is not None and importlib.util.find_spec("onnxscript") is not None:
        from mha_deploy.exporters.torch_export import list_torchlib_ops_once

        list_torchlib_ops_once()


@pytest.fixture(autouse=True)
def _provider_pinned(request, monkeypatch):
    """Every session a test creates names its provider, unless the test is about ``auto`` itself.

    On a GPU runner ``auto`` lands on CUDA, where ``session.provider`` is "cuda" and
    outputs differ from the CPU's beyond fp32 tolerances (TF32, other kernels): a test
    that expects the CPU must ask for it. This makes ``auto`` an error in tests here,
    where it would quietly land on the CPU and hide the dependency. Servers and CLIs
    started in subprocesses escape it: their helpers pass ``--provider cpu``.
    """
    if request.node.get_closest_marker("auto_provider"):
        return
    from mha_deploy.runtime import providers, session

    real = providers.plan_providers

    def plan(requested: str):
        if requested == "auto":
            raise AssertionError(
                "a session with provider 'auto' lands on CUDA on a GPU runner: pass provider='cpu' "
                "(--provider cpu), or mark the test cuda and ask for 'cuda'"
            )
        return real(requested)

    monkeypatch.setattr(providers, "plan_providers", plan)
    monkeypatch.setattr(session, "plan_providers", plan)


@pytest.fixture(scope="session")
def cuda_probe() -> str | None:
    """Why a tiny session does not land on ORT's CUDA provider here, or None when it does.

    Asked of ORT itself (a one-op session created and run with the options every
    CUDA session gets), not of the libraries: a host can have them all and still
    no usable GPU, and ORT only falls back to the CPU with a log line.
    """
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from mha_deploy.errors import ProviderUnavailableError
    from mha_deploy.runtime.providers import CUDA_EP, plan_providers

    try:
        plan = plan_providers("cuda")
    except ProviderUnavailableError as exc:
        return str(exc)
    value = [helper.make_tensor_value_info(name, TensorProto.FLOAT16, [2]) for name in ("a", "b")]
    graph = helper.make_graph([helper.make_node("Add", ["a", "a"], ["b"])], "probe", value[:1], value[1:])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    try:
        session = ort.InferenceSession(model.SerializeToString(), providers=plan.session_providers())
        session.run(None, {"a": np.ones(2, np.float16)})
    except Exception as exc:  # ORT's own error types
        return f"a tiny CUDA session fails: {exc}"
    if CUDA_EP not in session.get_providers():
        return "a tiny session fell back to the CPU (no usable GPU, or CUDA could not be initialised)"
    return None


@pytest.fixture
def on_cuda(cuda_probe):
    """Skips the test, with the reason, unless a tiny session lands on CUDA."""
    if cuda_probe is not None:
        pytest.skip(f"needs a session on CUDA: {cuda_probe}")


# Models written as users write them, each with build() and INPUTS (tests/user_models).
USER_MODELS = Path(__file__).parent / "user_models"


def user_module(name: str):
    """tests/user_models/<name>.py, imported as its own top-level module (its files import one another)."""
    sys.path.insert(0, str(USER_MODELS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(USER_MODELS))


@pytest.fixture(scope="session")
def own_model(tmp_path_factory):
    """``own_model(name, factory="build") -> (path, CLI output)``: tests/user_models/<name>.py exported once per
    session through ``mha-deploy export --module <name>.py:<factory> --input ...`` (what users run)."""
    from click.testing import CliRunner

    from mha_deploy.cli import main

    cache = {}

    def export(name: str, factory: str = "build"):
        if (name, factory) not in cache:
            file_name = f"{name}.onnx" if factory == "build" else f"{name}-{factory}.onnx"

            def write(folder: Path) -> dict:
                inputs = [arg for spec in user_module(name).INPUTS for arg in ("--input", spec)]
                with traces_shared(tmp_path_factory, name, factory):
                    result = CliRunner().invoke(
                        main, ["export", "--module", f"{USER_MODELS / name}.py:{factory}", *inputs, "-o",
                               str(folder / file_name)]
                    )
                return {"exit_code": result.exit_code, "output": result.output}

            # a failure is cached too: every test of that model then fails at once, with the export's words
            folder, record = exported_once(tmp_path_factory, ("own_model", name, factory), write)
            cache[name, factory] = folder / file_name, record
        path, record = cache[name, factory]
        assert record["exit_code"] == 0, record["output"]
        return path, record["output"]

    return export


# A user's module against its export: per-token outputs on real rows, per-item outputs whole; fp32 through
# different kernels.
OWN_MODEL_ATOL, OWN_MODEL_RTOL = 2e-5, 1e-4


def module_feeds(session, batch: int, lengths: dict[str, int], side: str, seed: int) -> dict:
    """Random inputs for a user's model at ``lengths`` per axis, padded on ``side`` where it has a mask."""
    from mha_deploy.inputs import padding_mask

    rng = np.random.default_rng(seed)
    feeds = {}
    for spec in session.signature.inputs:
        length = lengths[spec.axes[1]]
        if spec.role == "tokens":
            feeds[spec.name] = rng.integers(0, spec.vocab, (batch, length))
        elif spec.role == "sequence":
            feeds[spec.name] = rng.standard_normal((batch, length, spec.axes[2])).astype(np.float32)
        else:
            feeds[spec.name] = padding_mask(batch, length, side, rng)
    return feeds


def assert_equals_module(session, module, feeds: dict, label: str) -> None:
    """``session`` (a user's export) and ``module`` (torch) agree on ``feeds``: real rows of per-token outputs
    (each along its own axis), per-item outputs whole, within OWN_MODEL_ATOL/RTOL."""
    import torch

    from mha_deploy.exporters.reference_form import without_fast_path
    from mha_deploy.inputs import real_rows

    signature = session.signature
    # As parity runs it: torch's fast path gives NaN on a query row with no visible key (reference_form).
    with torch.no_grad(), without_fast_path():
        expected = module.eval()(*(torch.from_numpy(feeds[n]) for n in signature.input_names))
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = session.run(feeds)
    rows = real_rows(signature, feeds)  # each length axis's real positions
    for spec, want in zip(signature.outputs, expected, strict=True):
        want, have = want.numpy(), got[spec.name]
        if spec.name in signature.per_token_outputs:
            real = rows[spec.axes[1]]
            want, have = want[real], have[real]
        np.testing.assert_allclose(have, want, atol=OWN_MODEL_ATOL, rtol=OWN_MODEL_RTOL,
                                   err_msg=f"{label}: {spec.name}")


# The holes layout with the module's own positions, for the tests about holes themselves (masked holes on a join,
# by-length cohorts for a file that counts positions over the cache width); every other generation test runs the
# default --kv-cache export, the ragged layout users get.
HOLES_LM = ("--no-position-ids", "--cache-layout", "holes")
# Logits at every position (a --kv-cache causal LM's default file computes them at each row's last token only): what
# a test scoring a prompt's own tokens, or checking every position of a call, reads.
EVERY_POSITION = ("--logits", "all")
HOLES_EVERY_POSITION = ("--cache-layout", "holes", *EVERY_POSITION)


def hf_family_kv_export(tmp_path_factory, family: str) -> tuple[Path, str]:
    """(file, CLI output): tests/user_models/hf_families.py's ``family`` written by ``save_pretrained`` beside the
    file (``hf/``) and exported with ``export --hf DIR --kv-cache`` alone, the defaults; once per run."""
    from click.testing import CliRunner

    from mha_deploy.cli import main

    def write(folder: Path) -> dict:
        user_module("hf_families").save(family, folder / "hf")
        result = CliRunner().invoke(main, ["export", "--hf", str(folder / "hf"), "--kv-cache", "-o",
                                           str(folder / "model.onnx")])
        assert result.exit_code == 0, result.output
        return {"output": result.output}

    folder, record = exported_once(tmp_path_factory, ("hf_family_kv", family), write)
    return folder / "model.onnx", record["output"]


@pytest.fixture(scope="session")
def lm_cache(tmp_path_factory):
    """``lm_cache(name, *flags) -> (path, CLI output)``: tests/user_models/<name>.py exported once per session with
    ``mha-deploy export --module ... --kv-cache`` and ``flags`` (e.g. ``--cache-layout holes``; the KV-cache tests
    and the generation server's share them)."""
    from click.testing import CliRunner

    from mha_deploy.cli import main

    cache = {}

    def export(name: str, *flags: str):
        if (name, flags) not in cache:
            def write(folder: Path) -> dict:
                inputs = [arg for spec in user_module(name).INPUTS for arg in ("--input", spec)]
                with traces_shared(tmp_path_factory, name, "build"):
                    result = CliRunner().invoke(
                        main, ["export", "--module", f"{USER_MODELS / name}.py:build", *inputs, "--kv-cache",
                               *flags, "-o", str(folder / f"{name}.onnx")]
                    )
                assert result.exit_code == 0, result.output
                return {"output": result.output}

            folder, record = exported_once(tmp_path_factory, ("lm_cache", name, flags), write)
            cache[name, flags] = folder / f"{name}.onnx", record["output"]
        return cache[name, flags]

    return export


@pytest.fixture(scope="session")
def ragged_lm(tmp_path_factory):
    """``ragged_lm(name) -> path``: tests/user_models/<name>.py's ``build()`` exported once per session with a KV
    cache and position_ids, the export whose attentions keep a ragged cache (metadata cache_layout "ragged")."""
    from mha_deploy.exporters import export_model

    cache = {}

    def export(name: str):
        if name not in cache:
            def write(folder: Path) -> dict:
                module = user_module(name)
                with traces_shared(tmp_path_factory, name, "build"):
                    export_model(module.build(), folder / f"{name}.onnx", module.INPUTS, kv_cache=True,
                                 position_ids=True)
                return {}

            cache[name] = exported_once(tmp_path_factory, ("ragged_lm", name), write)[0] / f"{name}.onnx"
        return cache[name]

    return export


@pytest.fixture(scope="session")
def seq2seq(tmp_path_factory):
    """(decoder, encoder, start id, vocabulary): a hand-written cache-aware encoder-decoder exported by torch as two
    files (tests/runtime/cached_seq2seq.py, ``build(seed=1)``), shared by the generation, serving and batch tests;
    its decoder takes encoder_attention_mask but no attention_mask of its own, and counts positions over its cache."""
    pytest.importorskip("torch")
    from tests.runtime import cached_seq2seq

    def write(folder: Path) -> dict:
        encoder, decoder = cached_seq2seq.build(seed=1)
        cached_seq2seq.export(encoder, decoder, folder / "encoder.onnx", folder / "decoder.onnx")
        return {}

    # once per run (tests/runtime/test_generation.py reads the same files beside the modules they came from)
    folder, _ = exported_once(tmp_path_factory, ("seq2seq", "cached_seq2seq", 1), write)
    return folder / "decoder.onnx", folder / "encoder.onnx", cached_seq2seq.START_ID, cached_seq2seq.VOCAB
