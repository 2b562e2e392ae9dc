"""``export --kv-cache --logits last`` against ``--logits all`` on benchmarks/llm_builder.py's Llama (hidden 512,
6 layers, 8 heads over 2 KV heads, 32k vocabulary, the same weights for both files): time to the first token and
each process's peak RSS, at a 1024-token prompt (batch 1, and batch 4: the logits of every position a batch's
prompt holds are batch x 1024 x 32k fp32, 128 MB a row).

A script, not a test:

    .venv/bin/python benchmarks/last_token_logits.py                    # ~10 min on a quiet 2-core machine
    .venv/bin/python benchmarks/last_token_logits.py --quick            # llm_builder's tiny Llama: checks it runs
    .venv/bin/python benchmarks/last_token_logits.py --workdir DIR      # keeps the files: a rerun measures them

Both files are ``mha-deploy export --hf DIR --kv-cache`` with ``--logits all`` or ``--logits last`` and nothing else;
each case runs each file in a fresh process of its own (llm_builder's "ours" probe: ``runtime.generation``, one
untimed run, then timed runs, median), the files in turn within each case, so that a noisy moment hits both alike.
The load average before and after says whether the cores were shared.

onnxruntime-genai's builder computes the LM head at every position unless asked otherwise (its ``prune_lm_head``
extra option, off by default, which keeps the last column whatever the padding): its default files are the
``--logits all`` case.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from llm_builder import QUICK, TARGET, THREADS, _probe, _reused, _run_tool, describe_file, write_llama

CHOICES = ("all", "last")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny Llama, short prompts: checks it runs")
    parser.add_argument("--workdir", type=Path, help="where the folder and files go, kept (default: a temporary one)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    print("command:", " ".join([Path(sys.executable).name, *sys.argv]), flush=True)
    if args.workdir is not None:
        workdir = args.workdir / ("quick" if args.quick else "target")
        workdir.mkdir(parents=True, exist_ok=True)
        figures = run(args.quick, workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="mha-last-token-bench-") as workdir:
            figures = run(args.quick, Path(workdir))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1))


def export(folder: Path, workdir: Path, logits: str) -> Path:
    path = workdir / f"logits-{logits}" / "model.onnx"
    if not _reused(path):
        _run_tool([str(Path(sys.executable).with_name("mha-deploy")), "export", "--hf", str(folder), "--kv-cache",
                   "--logits", logits, "-o", str(path)], f"mha-deploy export --logits {logits}")
    return path


def run(quick: bool, workdir: Path) -> dict:
    from mha_deploy.bench.timing import load_average, load_line

    sizes = QUICK if quick else TARGET
    before = load_average()
    started = time.perf_counter()
    folder = write_llama(sizes, workdir / "llama")
    files = {logits: export(folder, workdir, logits) for logits in CHOICES}
    for logits, path in files.items():
        described = describe_file(path)
        print(f"  --logits {logits}: {described['size_mb']:.1f} MB, {described['nodes']} nodes", flush=True)
    rng = np.random.default_rng(0)
    cases = {f"first token, batch {batch} x {sizes.long_prompt}":
             rng.integers(3, sizes.vocab, (batch, sizes.long_prompt)).tolist() for batch in (1, 4)}
    results: dict[str, dict[str, dict]] = {case: {} for case in cases}
    for case, prompts in cases.items():
        for logits, path in files.items():
            request = {"model": str(path), "prompts": prompts, "new": 1, "repeats": 2 * sizes.repeats + 1,
                       "threads": THREADS}
            results[case][logits] = _probe(Path(sys.executable), "ours", request, workdir)
        print(f"measured {case}", flush=True)
    after = load_average()
    print(f"\n{'case':<32} {'--logits':<9} {'first token s':>14} {'peak RSS MB':>12}")
    figures = {}
    for case, rows in results.items():
        for logits, result in rows.items():
            median = statistics.median(result["seconds"])
            figures.setdefault(case, {})[logits] = {"seconds": median, "peak_rss_mb": result["peak_rss_mb"],
                                                    "runs": result["seconds"]}
            print(f"{case:<32} {logits:<9} {median:>14.3f} {result['peak_rss_mb']:>12.0f}")
        last, every = figures[case]["last"], figures[case]["all"]
        same = rows["last"]["tokens"] == rows["all"]["tokens"]
        figures[case]["last / all"] = {"seconds": last["seconds"] / every["seconds"],
                                       "peak_rss_mb": last["peak_rss_mb"] / every["peak_rss_mb"], "same_tokens": same}
        print(f"{case:<32} {'last/all':<9} {last['seconds'] / every['seconds']:>14.2f} "
              f"{last['peak_rss_mb'] / every['peak_rss_mb']:>12.2f}   same first tokens: {same}")
    print(load_line(before, after, THREADS))
    print(f"the run took {time.perf_counter() - started:.0f} s")
    return {"threads": THREADS, "figures": figures, "load_before": before, "load_after": after}


if __name__ == "__main__":
    main()
