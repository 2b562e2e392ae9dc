"""Latency of the reference MHA: torch eager, torch SDPA, ORT unfused, ORT fused per target.

A script, not a test:

    .venv/bin/python benchmarks/fusion.py            # all shapes, ~5 min on 2 cores
    .venv/bin/python benchmarks/fusion.py --quick    # small shapes only
    .venv/bin/python benchmarks/fusion.py --mask padding-causal

Every runner uses 2 threads (torch.set_num_threads / ORT intra_op_num_threads);
ORT sessions run with the default graph optimizations ("all"), as served.
Reported: median milliseconds per call and the speed-up over torch eager
(``eager ms / variant ms``; > 1 is faster). Each variant's output is checked
against torch eager on real query rows before it is timed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from mha_deploy.exporters.export import set_metadata
from mha_deploy.exporters.fusion import fuse_attention
from mha_deploy.exporters.graphs import attention_graph, build_attention_mask
from mha_deploy.exporters.parity import ParityCase, make_inputs, real_query_rows
from mha_deploy.exporters.torch_export import export_onnx
from mha_deploy.metadata import MASK_MODES, ModelMetadata, Signature
from mha_deploy.models.attention import MultiHeadAttention
from mha_deploy.runtime.session import MHASession

D_MODEL, HEADS, THREADS = 512, 8, 2
SHAPES = [(8, 128), (1, 1024), (32, 64), (1, 4096)]  # (batch, seq)
QUICK_SHAPES = [(8, 128), (32, 64)]
# Per shape, PASSES passes over all variants; in each pass a variant runs one
# untimed call then a block of timed calls (at least MIN_CALLS, more while
# under BLOCK_S). Blocks, not single interleaved calls: ORT's intra-op threads
# spin for a while after a run and would steal the 2 cores from the next torch
# call. Several passes: load from other processes hits all variants alike.
PASSES, MIN_CALLS, MAX_CALLS, BLOCK_S = 5, 2, 20, 0.4
# (label, fusion target, packed_qkv); target None = the unfused export.
ORT_VARIANTS = [
    ("ORT unfused", None, False),
    ("ORT fused mha (MultiHeadAttention)", "mha", False),
    ("ORT fused mha packed (Attention)", "mha", True),
    ("ORT fused onnx (Attention)", "onnx", False),
]


class TorchSDPA(torch.nn.Module):
    """The reference's weights with F.scaled_dot_product_attention in the middle (same I/O as SelfAttentionGraph)."""

    def __init__(self, mha: MultiHeadAttention, signature: Signature):
        super().__init__()
        self.mha, self.signature = mha, signature

    def forward(self, x, key_padding_mask=None):
        mha = self.mha
        q, k, v = (mha.split_heads(proj(x)) for proj in (mha.W_q, mha.W_k, mha.W_v))
        seq = x.shape[1]
        causal = self.signature.is_causal and key_padding_mask is None
        mask = None if causal else build_attention_mask(key_padding_mask, seq, seq, self.signature.is_causal)
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return mha.W_o(mha.merge_heads(context))


class QuietGate:
    """Wait, before each block, until other processes leave the CPUs alone (Linux /proc/stat).

    torch's OpenMP threads suffer badly from sharing 2 cores (x10 slower when
    another process is busy, ORT x3-4), so a block only starts once the rest
    of the machine used < QUIET_FRACTION of the CPUs over a short probe, or
    after QUIET_WAIT_S; the blocks that had to start anyway are counted.
    """

    QUIET_FRACTION, QUIET_WAIT_S, TOTAL_WAIT_S, PROBE_S = 0.1, 15.0, 360.0, 0.3

    def __init__(self):
        self.blocks = self.noisy = 0
        self.waited = 0.0

    @staticmethod
    def _others_busy_fraction(interval: float) -> float | None:
        def busy_and_own():
            try:
                with open("/proc/stat") as stat:
                    fields = [int(v) for v in stat.readline().split()[1:]]
            except OSError:
                return None
            idle = fields[3] + fields[4]  # idle + iowait
            return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK"), time.process_time()

        before = busy_and_own()
        time.sleep(interval)
        after = busy_and_own()
        if before is None or after is None:
            return None
        others = (after[0] - before[0]) - (after[1] - before[1])
        return max(0.0, others) / (interval * (os.cpu_count() or 1))

    def wait(self) -> None:
        self.blocks += 1
        started = time.perf_counter()
        budget = min(self.QUIET_WAIT_S, max(0.0, self.TOTAL_WAIT_S - self.waited))
        try:
            while True:
                fraction = self._others_busy_fraction(self.PROBE_S)
                if fraction is None or fraction < self.QUIET_FRACTION:
                    return
                if time.perf_counter() - started >= budget:
                    self.noisy += 1
                    return
        finally:
            self.waited += time.perf_counter() - started


GATE = QuietGate()


def median_ms(calls: dict[str, object]) -> dict[str, float]:
    """label -> median ms of ``call()`` over blocks of calls in several passes."""
    times: dict[str, list[float]] = {label: [] for label in calls}
    for _ in range(PASSES):
        for label, call in calls.items():
            GATE.wait()
            call()  # untimed: allocations, kernel selection, other pools winding down
            block: list[float] = []
            started = time.perf_counter()
            while len(block) < MIN_CALLS or (len(block) < MAX_CALLS and time.perf_counter() - started < BLOCK_S):
                t0 = time.perf_counter()
                call()
                block.append(time.perf_counter() - t0)
            times[label] += block
    return {label: statistics.median(samples) * 1e3 for label, samples in times.items()}


def build_runners(signature: Signature) -> dict[str, object]:
    """label -> function(feeds) -> output [batch, seq, d_model] as numpy."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(D_MODEL, HEADS).eval()
    reference = attention_graph(mha, signature)
    sdpa = TorchSDPA(mha, signature).eval()
    names = signature.input_names

    def torch_runner(module):
        def run(feeds):
            with torch.inference_mode():
                return module(*(torch.from_numpy(feeds[n]) for n in names)).numpy()

        return run

    runners = {"torch eager (reference)": torch_runner(reference), "torch F.sdpa": torch_runner(sdpa)}
    model = export_onnx(reference, signature, D_MODEL)
    set_metadata(model, ModelMetadata(d_model=D_MODEL, num_heads=HEADS, signature=signature))
    for label, target, packed in ORT_VARIANTS:
        candidate = model
        if target is not None:
            candidate, report = fuse_attention(model, target, packed_qkv=packed)
            if not report.complete:
                print(f"  skipped {label}: {report.summary()}")
                continue
        session = MHASession(candidate.SerializeToString(), provider="cpu", threads=THREADS, optimization="all")
        runners[label] = lambda feeds, session=session: session.run(feeds)["output"]
    return runners


def benchmark(signature: Signature, shapes) -> dict[str, dict[tuple, float]]:
    runners = build_runners(signature)
    results: dict[str, dict[tuple, float]] = {label: {} for label in runners}
    for batch, seq in shapes:
        feeds = make_inputs(signature, D_MODEL, ParityCase(batch, seq, seq, "right"))
        rows = real_query_rows(signature, feeds)
        expected = None
        for label, run in runners.items():
            output = run(feeds)
            if expected is None:
                expected = output
                continue
            err = float(np.abs(output[rows] - expected[rows]).max())
            if not err <= 1e-3:
                print(f"  warning: {label} at {batch}x{seq} differs from eager by {err:.3g}")
        medians = median_ms({label: (lambda run=run, feeds=feeds: run(feeds)) for label, run in runners.items()})
        for label, ms in medians.items():
            results[label][(batch, seq)] = ms
        print(f"  {batch}x{seq} done", flush=True)
    return results


def print_table(signature: Signature, shapes, results) -> None:
    eager = results["torch eager (reference)"]
    header = f"{'mask=' + signature.mask:36s}" + "".join(f"{f'({b},{s})':>22s}" for b, s in shapes)
    print()
    print(header)
    print("-" * len(header))
    for label, row in results.items():
        cells = "".join(
            f"{f'{row[shape]:.2f} ms ({eager[shape] / row[shape]:.2f}x)':>22s}" if shape in row else f"{'-':>22s}"
            for shape in shapes
        )
        print(f"{label:36s}{cells}")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"only the small shapes {QUICK_SHAPES}")
    parser.add_argument("--mask", choices=MASK_MODES, action="append", help="mask mode(s); default none and padding")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    print(
        f"self-attention, d_model {D_MODEL}, {HEADS} heads, {THREADS} threads, fp32 CPU; "
        f"median ms (speed-up over torch eager)"
    )
    print(f"load average before: {_load()}")
    for mask in args.mask or ["none", "padding"]:
        signature = Signature("self", mask)
        print(f"mask={mask}:")
        print_table(signature, shapes, benchmark(signature, shapes))
    # Other processes on the same cores inflate every figure: say how busy the machine was.
    print(f"load average after: {_load()} (1/5/15 min; above {THREADS} means the cores were shared)")
    print(
        f"{GATE.noisy} of {GATE.blocks} timed blocks started while other processes used more than "
        f"{QuietGate.QUIET_FRACTION:.0%} of the CPUs (waited {GATE.waited:.0f} s in all for quiet moments)"
    )


def _load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


if __name__ == "__main__":
    main()
