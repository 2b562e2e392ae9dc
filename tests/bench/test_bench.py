"""mha-deploy bench: cases, the error column against torch, the SDPA masks, the memory probe, CUDA, the CLI.

Kept fast: d_model 64, 4 heads, shapes of a few dozen tokens, budgets of a few
milliseconds, a 32³ GEMM yardstick, and torch-only backends wherever no ONNX
file is needed. Timings are never asserted, only that every row has them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from mha_deploy.bench import Backend, BenchTarget, MaskMode, QuietGate, parse_mask_modes, parse_shapes, run_bench
from mha_deploy.bench.backends import torch_eager, torch_sdpa
from mha_deploy.bench.memory import measure_peak_rss
from mha_deploy.bench.plot import latency_figure, plot_latency
from mha_deploy.bench.target import resolve_target
from mha_deploy.bench.timing import mha_flops
from mha_deploy.cli import main
from mha_deploy.errors import MHADeployError, OptionError, ProviderUnavailableError
from mha_deploy.exporters import export_mha
from mha_deploy.metadata import Signature
from mha_deploy.models import MultiHeadAttention
from tests.conftest import TEST_D_MODEL, TEST_HEADS, signature_id

MODES = parse_mask_modes(["none,padding,padding-25%,causal,padding-causal"])
SHAPES = ((2, 16), (1, 33))
FAST = {"threads": 1, "budget_s": 0.01, "gemm_sizes": (32,)}


def _cuda_reason() -> str | None:
    try:
        resolve_target("cuda")
    except ProviderUnavailableError as exc:
        return str(exc)
    return None


CUDA_REASON = _cuda_reason()


# --- cases -------------------------------------------------------------------------------------


def test_parse_shapes():
    assert parse_shapes("8x128, 1X1024") == ((8, 128), (1, 1024))


@pytest.mark.parametrize("text", ["8", "8x", "ax1", "0x5", "2x3x4"])
def test_bad_shapes(text):
    with pytest.raises(MHADeployError, match="shape"):
        parse_shapes(text)


def test_mha_flops_counts_projections_and_attention():
    # 4 projections of [B*S, d] x [d, d] at 2 FLOPs per MAC, plus QK^T and PV at 2·B·S²·d each.
    assert mha_flops(8, 128, 512) == 4 * 2 * 8 * 128 * 512**2 + 2 * 2 * 8 * 128**2 * 512


@pytest.mark.parametrize(("text", "mask", "padded"), [
    ("padding", "padding", 0.0), ("padding-25%", "padding", 25.0), ("Padding-Causal-12.5%", "padding-causal", 12.5),
])
def test_mask_mode_labels(text, mask, padded):
    mode = MaskMode.parse(text)
    assert (mode.mask, mode.padded_pct, mode.label) == (mask, padded, text.lower())


@pytest.mark.parametrize("text", ["bogus", "causal-25%", "padding-100%", "none-0%x", ""])
def test_bad_mask_modes(text):
    with pytest.raises(OptionError, match="mask mode"):
        parse_mask_modes([text])


@pytest.mark.parametrize(("mode", "real_keys"), [("padding", 32), ("padding-25%", 24), ("padding-causal-25%", 24)])
def test_padding_inputs_keep_every_key_real_unless_asked(mode, real_keys):
    feeds = MaskMode.parse(mode).inputs(TEST_D_MODEL, 3, 32)
    assert feeds["x"].dtype == np.float32
    assert (feeds["key_padding_mask"].sum(axis=1) == real_keys).all()


# --- one torch-only run over every mask mode, with defective backends -------------------------


@pytest.fixture(scope="module")
def mha():
    torch.manual_seed(0)
    return MultiHeadAttention(TEST_D_MODEL, TEST_HEADS).eval()


def scaled(backend: Backend, factor: float) -> Backend:
    """A backend computing a different function: ``backend``'s output times ``factor``."""

    def prepare(feeds):
        run = backend.prepare(feeds)
        return lambda: run() * factor

    return Backend(f"{backend.name} x{factor}", prepare, backend.precision, backend.signature)


def causality_dropped(mha: MultiHeadAttention, signature: Signature) -> Backend:
    """SDPA built for the signature without its causal mask: the bug the SDPA row once had."""
    acausal = torch_sdpa(mha, Signature(signature.attention, "padding" if signature.has_padding_mask else "none"))
    return Backend("SDPA, causal dropped", acausal.prepare, signature=signature)


DEFECTS = {"output x1.1": "torch eager x1.1", "causal dropped": "SDPA, causal dropped"}


@pytest.fixture(scope="module")
def torch_report(mha):
    def backends(signature):
        eager = torch_eager(mha, signature)
        return [eager, torch_sdpa(mha, signature), scaled(eager, 1.1), causality_dropped(mha, signature)]

    gate = QuietGate(wait_s=0.0, probe_s=0.001)
    return run_bench(mha, MODES, SHAPES, backends=backends, gate=gate, **FAST)


def rows_of(report, mask: str, backend: str):
    rows = [r for r in report.rows if r.mask == mask and r.backend == backend]
    assert len(rows) == len(SHAPES), (mask, backend, [(r.mask, r.backend) for r in report.rows])
    return rows


def test_every_row_has_its_mode_timing_and_error(torch_report):
    assert torch_report.mask_modes == [mode.label for mode in MODES]
    assert {r.mask for r in torch_report.rows} == {mode.label for mode in MODES}
    assert len(torch_report.rows) == len(MODES) * len(SHAPES) * 4
    for row in torch_report.rows:
        assert row.median_ms > 0 and row.p90_ms >= row.median_ms and row.gflops > 0 and row.vs_torch_eager > 0
        assert np.isfinite(row.max_abs_err) and np.isfinite(row.rel_err)
    assert all(r.max_abs_err == 0 and r.vs_torch_eager == 1 for r in torch_report.rows if r.backend == "torch eager")
    table = torch_report.table()
    assert "max abs err" in table and "rel err" in table and "padding-25%" in table and "load average" in table
    assert "timed blocks" in torch_report.quiet


@pytest.mark.parametrize("mask", [mode.label for mode in MODES])
def test_sdpa_computes_the_reference_under_every_mask(torch_report, mask):
    """SDPA with the same mask: is_causal for causal, one bool mask of padding and causality for padding-causal."""
    for row in rows_of(torch_report, mask, "torch SDPA"):
        assert row.max_abs_err < 1e-4 and row.within_tolerance, row


@pytest.mark.parametrize(("defect", "mask"), [
    *(("output x1.1", mode.label) for mode in MODES),
    ("causal dropped", "causal"),
    ("causal dropped", "padding-causal"),
])
def test_a_backend_computing_another_function_shows_a_large_error(torch_report, defect, mask):
    for row in rows_of(torch_report, mask, DEFECTS[defect]):
        assert row.max_abs_err > 1e-2 and row.rel_err > 1e-2 and not row.within_tolerance, row
    assert "DIFFERS" in torch_report.table()


def test_plot_has_one_panel_per_mask_mode(torch_report, tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "bench.png"
    plot_latency(torch_report, plot)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _timings_between(report, low_us: float, high_us: float):
    """The report with every row's time per token spread over [low_us, high_us]."""
    import dataclasses

    count = len(report.rows)
    rows = [dataclasses.replace(row, median_ms=(low_us + (high_us - low_us) * i / max(1, count - 1))
                                * row.batch * row.seq / 1e3)
            for i, row in enumerate(report.rows)]
    return dataclasses.replace(report, rows=rows)


@pytest.mark.parametrize("spread", ["measured", "across one 1-2-5 step", "inside one step", "one value"])
def test_plot_labels_its_log_axis_in_plain_numbers_and_marks_the_default_export(torch_report, spread):
    """Two labelled ticks in every panel whatever the timings.

    Bars from 6 to 12 µs failed in CI: one step (10) inside the autoscaled limits, so one labelled tick.
    """
    pytest.importorskip("matplotlib")
    import dataclasses

    import matplotlib.pyplot as plt

    report = {"measured": torch_report,
              "across one 1-2-5 step": _timings_between(torch_report, 6.0, 12.0),
              "inside one step": _timings_between(torch_report, 5.5, 9.5),
              "one value": _timings_between(torch_report, 7.0, 7.0)}[spread]
    report = dataclasses.replace(report, default_export={mode.label: "torch SDPA" for mode in MODES})
    fig = latency_figure(report)
    fig.canvas.draw()
    axes = fig.axes
    assert len(axes) == len(MODES)
    for ax in axes:
        low, high = ax.get_ylim()
        shown = [t for t in ax.yaxis.get_major_ticks() if low <= t.get_loc() <= high and t.label1.get_text()]
        # At least two labelled ticks inside the panel, each a plain number (no 10^k mathtext).
        assert len(shown) >= 2, [t.label1.get_text() for t in ax.yaxis.get_major_ticks()]
        assert all(float(t.label1.get_text()) == pytest.approx(t.get_loc(), rel=1e-3) for t in shown)
        hatched = {bar.get_label() for container in ax.containers for bar in [container]
                   if all(patch.get_hatch() for patch in container.patches)}
        assert hatched == {"torch SDPA"}
        assert "the default export" in ax.get_title(loc="left")
    plt.close(fig)


# --- the memory probe: inputs from the model file's own metadata --------------------------------


@pytest.mark.parametrize("signature", [Signature("self", "padding"), Signature("cross", "padding")],
                         ids=signature_id)
def test_memory_probe_sees_the_attention_matrix(export_model, signature):
    """Unfused, the scores [1, heads, 2048, 2048] fp32 (64 MiB at 4 heads) must show up in the run's peak."""
    path, _ = export_model(signature, "none")
    small = measure_peak_rss(path, "ORT none", 1, 64, threads=1, arena=False)
    large = measure_peak_rss(path, "ORT none", 1, 2048, threads=1, arena=False)
    assert (small.mask, large.batch, large.seq) == (signature.mask, 1, 2048)
    assert large.run_mb - small.run_mb > 60


# --- CUDA: one device and one dtype for every row, or refused up front -------------------------


@pytest.fixture(scope="module")
def fp16_model(mha, tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-fp16") / "fp16.onnx"
    export_mha(mha, path, Signature("self", "padding"), dtype="fp16")
    return path


def test_fp16_target_feeds_every_row_and_the_probe_in_fp16(mha, fp16_model):
    """What --provider cuda does (fp16 torch, fp16 feeds, probe and GEMM in fp16), on the CPU provider."""
    target = BenchTarget("cpu", "fp16")

    def backends(signature):
        return [torch_eager(mha, signature, target), torch_sdpa(mha, signature, target)]

    modes = parse_mask_modes(["padding-25%"])
    report = run_bench(mha, modes, ((2, 16),), target=target, backends=backends, models=[fp16_model],
                       memory_shapes=((1, 16),), **FAST)
    assert report.dtype == "fp16" and report.gemm_gflops > 0
    assert [r.backend for r in report.rows] == ["torch eager", "torch SDPA", "fp16.onnx"]
    eager, *half = report.rows
    assert eager.max_abs_err == 0, "the reference module stays fp32: its -1e9 mask fill overflows fp16"
    for row in half:
        # fp16 against the fp32 reference: rounding, judged by the fp16 export tolerance.
        assert 0 < row.max_abs_err < 5e-3 and row.within_tolerance, row
    assert [(m.backend, m.mask, m.arena) for m in report.memory] == [
        ("fp16.onnx", "padding-25%", True), ("fp16.onnx", "padding-25%", False),
    ]


def test_a_model_file_must_match_a_mask_mode(mha, fp16_model):
    with pytest.raises(OptionError, match="--mask padding"):
        run_bench(mha, parse_mask_modes(["none"]), ((1, 4),), backends=lambda s: [], models=[fp16_model], **FAST)


@pytest.mark.skipif(CUDA_REASON is None, reason="CUDA is usable here; this tests its absence")
def test_cli_bench_refuses_cuda_up_front():
    result = CliRunner().invoke(main, ["bench", "--provider", "cuda", "--d-model", "64", "--heads", "4"])
    assert result.exit_code == 1
    assert "bench --provider cuda runs torch and ONNX Runtime on the GPU, but" in result.stderr
    assert "exporting" not in result.stderr  # refused before any work


@pytest.mark.skipif(CUDA_REASON is None, reason="CUDA is usable here; this tests its absence")
@pytest.mark.parametrize("gpu", [True, False], ids=["gpu-without-cuda-libraries", "no-gpu"])
def test_auto_provider_falls_back_to_cpu_with_a_note_where_a_gpu_exists(monkeypatch, gpu):
    from mha_deploy.runtime import providers

    monkeypatch.setattr(providers, "gpu_present", lambda: gpu)
    target = resolve_target("auto")
    assert (target.provider, target.dtype) == ("cpu", "fp32")
    assert target.note.startswith("using CPU:") if gpu else target.note == ""


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_REASON is not None, reason=f"needs CUDA for torch and ORT: {CUDA_REASON}")
def test_cuda_bench_runs_every_row_on_the_gpu(mha):
    target = resolve_target("cuda")
    report = run_bench(mha, parse_mask_modes(["padding-causal"]), ((2, 16),), target=target,
                       memory_shapes=((1, 16),), **FAST)
    assert (report.provider, report.dtype) == ("cuda", "fp16")
    assert all(r.within_tolerance for r in report.rows), report.table()


# --- the CLI: default backends end to end ------------------------------------------------------


def test_cli_bench_json_and_plot(tmp_path):
    plot = tmp_path / "bench.png"
    result = CliRunner().invoke(main, [
        "bench", "--d-model", str(TEST_D_MODEL), "--heads", str(TEST_HEADS), "--mask", "padding-causal",
        "--shapes", "2x8", "--budget-s", "0.01", "--threads", "1", "--memory-shapes", "", "--gemm-sizes", "32",
        "--json", "--plot", str(plot),
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    rows = {r["backend"]: r for r in report["rows"]}
    # OpenVINO joins by default when its extra is installed, which CI's set-up checks it is.
    assert list(rows) == ["torch eager", "torch SDPA", "ORT none", "ORT mha", "ORT onnx", "ORT mha int8-dynamic",
                          "OpenVINO"]
    assert all(r["mask"] == "padding-causal" for r in report["rows"])
    for name, row in rows.items():
        assert row["within_tolerance"], row
        assert row["rel_err"] < (0.05 if name.endswith("int8-dynamic") else 1e-5), row
    assert rows["ORT mha int8-dynamic"]["rel_err"] > 0  # int8 error is measured, not assumed
    assert "the default export (--fuse auto) is, per mask mode, padding-causal: ORT mha" in report["notes"][0]
    assert report["default_export"] == {"padding-causal": "ORT mha"}
    # int8-dynamic rows against ORT's int8 GEMM of the same run, the others against its float MatMul.
    assert report["int8_gemm_gops"] > 0
    for name, row in rows.items():
        peak = report["int8_gemm_gops"] if name.endswith("int8-dynamic") else report["gemm_gflops"]
        assert row["efficiency"] == pytest.approx(row["gflops"] / peak), name
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("quantize", [[], ["--quantize", "int4"]], ids=["fp32", "int4"])
def test_cli_bench_of_a_model_file_reads_its_width_heads_and_mask(tmp_path, quantize):
    """No --d-model, --heads or --mask: a narrow padding model is benched at its own size, in its own mask mode; a
    weight-only int4 file is one more row beside the fp32 ones, judged by its export's relative budget."""
    model = tmp_path / "narrow.onnx"
    assert CliRunner().invoke(main, ["export", "--d-model", "32", "--heads", "2", "--mask", "padding", *quantize,
                                     "-o", str(model)]).exit_code == 0
    result = CliRunner().invoke(main, [
        "bench", str(model), "--shapes", "2x8", "--budget-s", "0.01", "--threads", "1", "--memory-shapes", "",
        "--gemm-sizes", "32", "--no-openvino", "--json",
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["d_model"], report["heads"], report["mask_modes"]) == (32, 2, ["padding"])
    (row,) = [r for r in report["rows"] if r["backend"] == "narrow.onnx"]
    assert row["within_tolerance"], row  # the same seed-0 model as the bench's reference


def test_cli_bench_refuses_flags_that_disagree_with_the_model_file(tmp_path):
    model = tmp_path / "narrow.onnx"
    assert CliRunner().invoke(main, ["export", "--d-model", "32", "--heads", "2", "-o", str(model)]).exit_code == 0
    result = CliRunner().invoke(main, ["bench", str(model), "--d-model", "512"])
    assert result.exit_code == 2 and "--d-model 512 disagrees with narrow.onnx, which has 32" in result.output
    assert "exporting" not in result.output  # refused before any work


def test_cli_default_memory_shapes_are_the_library_default():
    from mha_deploy.bench.cases import DEFAULT_MEMORY_SHAPES

    (option,) = [p for p in main.commands["bench"].params if p.name == "memory_shapes"]
    assert parse_shapes(option.default) == DEFAULT_MEMORY_SHAPES


@pytest.mark.parametrize(("option", "value"), [("--mask", "causal-25%"), ("--shapes", "8"), ("--gemm-sizes", "a")])
def test_cli_bench_bad_values_are_usage_errors(option, value):
    result = CliRunner().invoke(main, ["bench", option, value])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
