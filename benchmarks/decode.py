"""Incremental decoding (KV cache) on the one bench harness: step latency, prefill, RSS over 1,000 steps.

A script, not a test:

    .venv/bin/python benchmarks/decode.py            # contexts 128/1024/4096, batch 1 and 8, ~4 min on 2 cores
    .venv/bin/python benchmarks/decode.py --quick    # contexts 128/1024, batch 1, 100 RSS steps

Self-attention, d_model 512, 8 heads, causal, 2 threads for torch and ORT, fp32 CPU;
each timed block waits for a quiet machine (up to 15 s, 60 s in all). The
targets of issue 11 are checked on this run's own figures and printed last.
"""

from __future__ import annotations

import argparse

import torch

from mha_deploy.bench import QuietGate
from mha_deploy.bench.decode import run_decode_bench
from mha_deploy.models import MultiHeadAttention

D_MODEL, HEADS, THREADS = 512, 8, 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="contexts 128 and 1024, batch 1, 100 RSS steps")
    args = parser.parse_args()
    torch.manual_seed(0)
    mha = MultiHeadAttention(D_MODEL, HEADS).eval()
    options = {"contexts": (128, 1024), "batches": (1,), "prefill_seqs": (1024,), "rss_steps": 100,
               "rss_context": 1024} if args.quick else {}
    report = run_decode_bench(mha, threads=THREADS, gate=QuietGate(wait_s=15.0, total_wait_s=60.0),
                              on_progress=lambda line: print(f"  {line}", flush=True), **options)
    print(report.table())


if __name__ == "__main__":
    main()
