"""The fusion study's settings on the one bench harness (``mha_deploy.bench``), with packed-QKV Attention added.

A script, not a test:

    .venv/bin/python benchmarks/fusion.py            # all shapes, ~5 min on 2 cores
    .venv/bin/python benchmarks/fusion.py --quick    # small shapes only
    .venv/bin/python benchmarks/fusion.py --mask padding-causal

Self-attention, d_model 512, 8 heads, 2 threads for torch and ORT, fp32 CPU;
each timed block waits for a quiet machine (up to 15 s). Every row shows its
error against torch eager on the same inputs, and its speed-up over torch eager.
"""

from __future__ import annotations

import argparse

import torch

from mha_deploy.bench import QuietGate, parse_mask_modes, run_bench
from mha_deploy.models import MultiHeadAttention

D_MODEL, HEADS, THREADS = 512, 8, 2
SHAPES = ((8, 128), (1, 1024), (32, 64), (1, 4096))
QUICK_SHAPES = ((8, 128), (32, 64))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"only the small shapes {QUICK_SHAPES}")
    parser.add_argument("--mask", action="append", help="mask mode(s), e.g. padding-25%%; default none and padding")
    args = parser.parse_args()
    torch.manual_seed(0)
    mha = MultiHeadAttention(D_MODEL, HEADS).eval()
    report = run_bench(
        mha, parse_mask_modes(args.mask or ["none", "padding"]), QUICK_SHAPES if args.quick else SHAPES,
        threads=THREADS, packed_qkv=True, gate=QuietGate(wait_s=15.0),
        on_row=lambda row: print(f"  {row.mask} {row.batch}x{row.seq} {row.backend} done", flush=True),
    )
    print(report.table())


if __name__ == "__main__":
    main()
