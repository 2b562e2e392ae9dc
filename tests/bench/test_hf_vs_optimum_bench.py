"""benchmarks/hf_vs_optimum.py without its run (which exports base-sized models and needs .venv-optimum: minutes):
the inputs each workload gets, Whisper's special ids moved into a small vocabulary, and the report's verdicts
against the issue's targets, a failed row saying why."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("hf_vs_optimum", ROOT / "benchmarks" / "hf_vs_optimum.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_workload_gets_its_inputs_under_hugging_faces_names():
    bench = _bench()
    bert = bench.make_inputs("bert-8x128", (8, 128), bench.SIZES["bert"])
    assert set(bert) == {"input_ids", "attention_mask", "token_type_ids"}
    assert (bert["attention_mask"].sum(1) == 96).all()  # a quarter of every row padded, on the right
    assert (bert["input_ids"][:, 96:] == 0).all() and (bert["input_ids"][:, :96] >= 3).all()
    assert bench.make_inputs("bert-1x512", (1, 512), bench.SIZES["bert"])["attention_mask"].all()
    assert bench.make_inputs("vit-8", (8, 224), bench.SIZES["vit"])["pixel_values"].shape == (8, 3, 224, 224)
    whisper = bench.make_inputs("whisper-8x32", (8, 32), bench.SIZES["whisper"])["input_features"]
    assert whisper.shape == (8, 80, 3000) and whisper.dtype == np.float32
    quick = bench.QUICK_SIZES["whisper"]
    assert [bench._id(token, quick) for token in (bench.START, bench.EOS)] == [999, 998]
    assert bench._id(bench.START, bench.SIZES["whisper"]) == bench.START


def test_the_report_says_which_targets_are_met_and_why_a_row_failed(capsys):
    bench = _bench()
    rows = {"ours": {"median_ms": 10.0, "attention_ops": {"model": {"MultiHeadAttention": 6}}},
            "optimum": {"median_ms": 13.0, "ours_speedup": 1.3, "max_abs_diff_torch": 1e-6},
            "optimum -O2": {"error": "ValueError: it failed"},
            "torch": {"median_ms": 40.0, "ours_speedup": 4.0}}
    whisper = {"ours": {"median_ms": 100.0, "tokens_equal_torch": True},
               "optimum": {"median_ms": 140.0, "ours_speedup": 1.4, "tokens_equal_torch": False},
               "torch": {"median_ms": 400.0, "ours_speedup": 4.0}}
    bench.print_report({"threads": 2, "quick": False, "optimum_env": "optimum-onnx 0.1.0",
                        "workloads": {"bert-8x128": {"shape": [8, 128], "sizes": {}, "rows": rows},
                                      "whisper-8x32": {"shape": [8, 32], "sizes": {}, "rows": whisper}},
                        "load_before": (1.0, 1.0, 1.0), "load_after": (2.0, 1.0, 1.0)})
    out = capsys.readouterr().out
    assert "optimum -O2  FAILED: ValueError: it failed" in out
    assert "ours 1.30x" in out and "max |diff| vs torch 1.0e-06" in out
    assert "(target >= 1.5x: NOT met)" in out and "(target >= 3.0x: met)" in out  # Whisper's two targets
    assert "TOKENS DIFFER from torch's" in out and "ours attention ops: {'model': {'MultiHeadAttention': 6}}" in out
    assert "per call (8 rows x 32 new tokens)" in out and "load average 1.00 1.00 1.00 before" in out


def test_a_profile_is_summed_per_op_type_and_call():
    bench = _bench()
    node = lambda op, us: {"cat": "Node", "name": f"n_{op}_kernel_time", "dur": us, "args": {"op_name": op}}  # noqa: E731
    events = [{"cat": "Session", "name": "model_run"}] * 2 + [
        node("MatMul", 3000), node("MatMul", 1000), node("MultiHeadAttention", 2000), node("Add", 400),
        node("Reshape", 200), {"cat": "Node", "name": "n_fence_before", "dur": 9999, "args": {"op_name": "MatMul"}}]
    assert bench.profile_by_op(events, top=2) == {"MatMul": 2.0, "MultiHeadAttention": 1.0, "other": 0.3, "calls": 2}


def test_the_split_says_where_each_pairs_time_goes(capsys):
    bench = _bench()
    ms = {"ours encoder": 3000.0, "ours decoder": 1000.0, "optimum encoder": 3300.0, "optimum first decoder": 500.0,
          "optimum decoder with past": 2200.0}
    bench.print_split({"tokens_equal": True, "median_ms": ms, "profile_ms_per_call": {"ours decoder": {"MatMul": 9.0}}})
    out = capsys.readouterr().out
    assert "tokens equal between the two pairs" in out
    # 6000 / 4000 in all; the encoders 3300 / 3000; decoding 2700 / 1000 (Optimum's first call included)
    assert "ours 1.50x; encoders alone 1.10x" in out and "first decoder included" in out and "2.70x" in out
    assert "profile ours decoder (kernel ms per call): {'MatMul': 9.0}" in out
