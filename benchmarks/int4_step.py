"""Where an int4 decode step's time goes: the file, the Python loop around it, or the runtime.

A script, not a test: the LLM bench (benchmarks/llm_builder.py) times our int4 file through ``runtime.generation``
and the builder's int4 folder through onnxruntime-genai's C++ loop, each on its own onnxruntime. This takes the
loop and the runtime out of that comparison: every ``--file`` is decoded by one plain onnxruntime session loop
(batch 1, greedy, each step's present caches fed back as the next step's past, nothing else around the call), and
each ``--generate`` file also through ``runtime.generation.generate`` as users run it (and each ``--engine`` file
through the serving engine, as ``serve`` runs it behind its routes); all of them interleaved in
one process (the order rotated every round), so that their ratios hold on a shared machine. Run it once per
onnxruntime to see the runtime's part:

    .venv/bin/python benchmarks/int4_step.py --file builder=B/model.onnx --file ours=O/model.onnx \\
        --generate ours=O/model.onnx --profile                      # onnxruntime-gpu 1.31.1 (its CPU provider)
    PYTHONPATH=. .venv-ort132/bin/python benchmarks/int4_step.py ...  # the same on onnxruntime 1.32.0
    PYTHONPATH=. VENV/bin/python benchmarks/int4_step.py ... --genai builder=B --genai ours=O
        # VENV: onnxruntime==1.32.0 onnxruntime-genai==0.18.0 onnx numpy; O with `mha-deploy genai-config --threads 2`

(B: the bench's ``target/builder-int4``, O: its ``target/mha-deploy-int4``; docs/precision.md has a run.) Printed:
each file's MatMulNBits attributes (bits, block size, accuracy_level, zero points or not) and projection count, the
milliseconds per decoded token (median over rounds; the prompt's prefill left out), each variant's ratio to the
first ``--file``, each ``--generate`` or ``--engine`` loop's host time (its thread's CPU time outside onnxruntime's
runs, per step),
and with ``--profile`` the per-op-type share of one decode step (onnxruntime's own profiler,
``enable_profiling``) at the same cache length. ``--symmetric-from FP32`` adds our fp32 file quantized as
``--quantize int4 --quantize-embeddings --symmetric`` would (scales only, the builder's form) as one more
``--file``. The load average is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", action="append", default=[], metavar="NAME=PATH",
                        help="a KV-cache decoder decoded by the plain session loop (the first is the ratios' base)")
    parser.add_argument("--generate", action="append", default=[], metavar="NAME=PATH",
                        help="one of ours decoded by runtime.generation.generate (KVCacheStepper)")
    parser.add_argument("--engine", action="append", default=[], metavar="NAME=PATH",
                        help="one of ours decoded by the serving engine (serving.engine.GenerationEngine, what serve "
                             "runs behind its routes), in this process, one request at a time")
    parser.add_argument("--genai", action="append", default=[], metavar="NAME=DIR",
                        help="a folder with its genai_config.json decoded by onnxruntime-genai in this process "
                             "(an environment with both: it takes the onnxruntime installed beside it)")
    parser.add_argument("--symmetric-from", type=Path, metavar="FP32",
                        help="our fp32 export: adds it quantized int4 with scales only as --file sym")
    parser.add_argument("--prompt", type=int, default=128, help="prompt length (random ids, seeded)")
    parser.add_argument("--new", type=int, default=128, help="new tokens per timed run")
    parser.add_argument("--rounds", type=int, default=5, help="timed runs per variant, interleaved")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="per-op-type time of one decode step per --file")
    args = parser.parse_args()
    import onnxruntime

    files = dict(_named(spec) for spec in args.file)
    if args.symmetric_from is not None:
        files["sym"] = _symmetric(args.symmetric_from)
    print(f"onnxruntime {onnxruntime.__version__}, {args.threads} threads, batch 1, prompt {args.prompt}, "
          f"{args.new} new tokens, {args.rounds} rounds; load average {_load()}")
    for name, path in files.items():
        print(f"{name}: {describe(path)}")
    variants = {f"{name} (plain loop)": PlainLoop(path, args.threads) for name, path in files.items()}
    for spec in args.generate:
        name, path = _named(spec)
        variants[f"{name} (runtime.generation)"] = OurLoop(path, args.threads)
    for spec in args.engine:
        name, path = _named(spec)
        variants[f"{name} (serving engine)"] = EngineLoop(path, args.threads)
    for spec in args.genai:
        name, path = _named(spec)
        variants[f"{name} (onnxruntime-genai)"] = GenaiLoop(path)
    prompt = np.random.default_rng(0).integers(3, min(1000, _vocabulary(args)), args.prompt).reshape(1, -1)
    seconds, prefills, tokens = defaultdict(list), defaultdict(list), {}
    for variant in variants.values():
        variant.decode(prompt, 2)  # untimed: first-run allocations
    names = list(variants)
    for round_ in range(args.rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            per_token, tokens[name], prefill = variants[name].decode(prompt, args.new)
            seconds[name].append(per_token)
            prefills[name].append(prefill)
    print(f"ms per decoded token (median of {args.rounds}; ratio: {names[0]}'s time over the row's in the same round, "
          "the median over rounds: above 1 faster)")
    for name in names:
        median = statistics.median(seconds[name])
        ratio = statistics.median(b / s for b, s in zip(seconds[names[0]], seconds[name], strict=True))
        # each file's loops must agree with one another on its greedy tokens (different files need not: each
        # quantizes its own way)
        twins = [other for other in names if other != name and other.split(" (")[0] == name.split(" (")[0]]
        same = ", ".join(("same tokens as " if tokens[o] == tokens[name] else "OTHER tokens than ") + o for o in twins)
        prefill = statistics.median(prefills[name])
        end_to_end = args.new / (prefill + median * (args.new - 1))  # new tokens/s as the LLM bench counts them
        host = getattr(variants[name], "host_seconds", None)
        host = f"  host {statistics.median(host[1:]) * 1e3:.3f} ms a step outside ORT's runs" if host else ""
        print(f"  {name:34} {median * 1e3:7.3f} ms  {ratio:5.2f}x  prefill {prefill * 1e3:6.1f} ms, "
              f"{end_to_end:5.0f} new tokens/s with it  {same}{host}")
    if args.profile:
        # Each file profiled in every round, interleaved like the timings: a step's op times are short enough for
        # one preemption to move them, so the median per op type over rounds is printed.
        shares = {name: defaultdict(list) for name in files}
        for _ in range(args.rounds):
            for name, path in files.items():
                for op, ms in profile_step(path, args.threads, prompt, args.new).items():
                    shares[name][op].append(ms)
        for name, ops in shares.items():
            medians = {op: statistics.median(values + [0.0] * (args.rounds - len(values)))
                       for op, values in ops.items()}
            total = sum(medians.values())
            length = args.prompt + max(args.new - 1, 16)
            print(f"one decode step of {name} at cache length {length}, by op type (onnxruntime's "
                  f"profiler: kernel time per step over the last 16 steps, median of {args.rounds} rounds; "
                  f"total {total:.3f} ms):")
            for op, ms in sorted(medians.items(), key=lambda kv: -kv[1]):
                if ms / total >= 0.005:
                    print(f"  {op:34} {ms:7.3f} ms {ms / total:6.1%}")
    print(f"load average {_load()} (1/5/15 min; above {os.cpu_count()} the cores were shared)")


def _named(spec: str) -> tuple[str, Path]:
    name, _, path = spec.partition("=")
    if not path:
        sys.exit(f"{spec!r}: give NAME=PATH")
    return name, Path(path)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def describe(path: Path) -> str:
    """The file's MatMulNBits: how many, their (bits, block, accuracy_level, zero points) forms, the head's N."""
    import onnx
    from onnx import helper

    model = onnx.load(str(path), load_external_data=False)
    forms, widest = defaultdict(int), 0
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
            zero_points = len(node.input) > 3 and bool(node.input[3])
            forms[(a["bits"], a["block_size"], a.get("accuracy_level", 0), zero_points)] += 1
            widest = max(widest, a["N"])
    ops = sorted({node.op_type for node in model.graph.node} - {"MatMulNBits"})
    kinds = "; ".join(f"{n} x {bits}-bit blocks of {block}, accuracy_level {level}, "
                      f"{'zero points' if zp else 'scales only'}" for (bits, block, level, zp), n in forms.items())
    return f"MatMulNBits {kinds}; widest N {widest} (the head); other ops {', '.join(ops)}"


def _vocabulary(args: argparse.Namespace) -> int:
    """The first model's vocabulary (its logits' last axis), so that a tiny model's prompt stays inside it."""
    import onnx

    files = [path for _, path in map(_named, args.file + args.generate + args.engine)]
    files += [path / "model.onnx" for _, path in map(_named, args.genai)]
    model = onnx.load(str(files[0]), load_external_data=False)
    logits = next(output for output in model.graph.output if output.name == "logits")
    return logits.type.tensor_type.shape.dim[-1].dim_value or 1000


class PlainLoop:
    """One onnxruntime session, fed as the file's inputs ask: the prompt, then one token a step with the presents
    as the next pasts (a growing cache, no shared buffer), position_ids where the file takes them."""

    def __init__(self, path: Path, threads: int, profile: bool = False):
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        if profile:
            options.enable_profiling = True
            options.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "step")
        self.session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.pasts = [n for n in self.inputs if n.startswith("past_key_values.")]
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.presents = [n.replace("past_key_values.", "present.") for n in self.pasts]
        past = self.inputs[self.pasts[0]].shape
        self.heads, self.head_dim = past[1], past[3]
        if not isinstance(self.head_dim, int):  # the builder leaves it symbolic; its genai_config says it
            config = json.loads((path.parent / "genai_config.json").read_text())["model"]["decoder"]
            self.head_dim = config["head_size"]
        self.float = np.float16 if "float16" in self.inputs[self.pasts[0]].type else np.float32

    def feeds(self, ids: np.ndarray, length: int, caches: list[np.ndarray]) -> dict:
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, length), np.int64)}
        if "position_ids" in self.inputs:
            feeds["position_ids"] = np.arange(length - ids.shape[1], length, dtype=np.int64).reshape(1, -1)
        feeds.update(zip(self.pasts, caches, strict=True))
        return feeds

    def run(self, feeds: dict) -> tuple[int, list[np.ndarray]]:
        out = dict(zip(self.outputs, self.session.run(None, feeds), strict=True))
        logits = out["logits"]
        return int(np.argmax(logits[0, -1] if logits.ndim == 3 else logits[0])), [out[p] for p in self.presents]

    def prefill(self, prompt: np.ndarray) -> tuple[int, list[np.ndarray]]:
        empty = [np.zeros((1, self.heads, 0, self.head_dim), self.float) for _ in self.pasts]
        return self.run(self.feeds(prompt, prompt.shape[1], empty))

    def decode(self, prompt: np.ndarray, new: int) -> tuple[float, list[int], float]:
        """Seconds per decoded token after the prompt's (its first token comes from the prefill), the tokens, and the
        prefill's seconds."""
        started = time.perf_counter()
        token, caches = self.prefill(prompt)
        prefill = time.perf_counter() - started
        tokens, started = [token], time.perf_counter()
        for step in range(new - 1):
            token, caches = self.run(self.feeds(np.array([[token]], np.int64), prompt.shape[1] + step + 1, caches))
            tokens.append(token)
        return (time.perf_counter() - started) / max(new - 1, 1), tokens, prefill


class OurLoop:
    """``runtime.generation.generate`` over ``KVCacheStepper`` as users run it; the prefill timed apart through the
    stepper so that only the decode steps (and the loop's own work between them) count."""

    def __init__(self, path: Path, threads: int):
        from mha_deploy.runtime.kv_stepper import KVCacheStepper

        self.stepper = KVCacheStepper(str(path), threads=threads)
        self.prefill_seconds = 0.0
        self.host_seconds: list[float] = []  # per decode: the loop's CPU time per call outside onnxruntime's runs
        prefill = self.stepper.prefill

        def timed_prefill(*args, **kwargs):
            started = time.perf_counter()
            try:
                return prefill(*args, **kwargs)
            finally:
                self.prefill_seconds = time.perf_counter() - started

        self.stepper.prefill = timed_prefill

    def decode(self, prompt: np.ndarray, new: int) -> tuple[float, list[int], float]:
        from mha_deploy.runtime.generation import generate

        # The host's part: the thread's CPU time between onnxruntime's calls (the loop's own work, measured where it
        # runs: after a step's weights have gone through the caches, not warm in a micro-benchmark).
        with _runs_timed() as calls:
            started, cpu = time.perf_counter(), time.thread_time()
            out = generate(self.stepper, prompt.astype(np.int64), max_new_tokens=new, eos_token_id=[])
            seconds = time.perf_counter() - started - self.prefill_seconds
            cpu = time.thread_time() - cpu
        steps = max(new - 1, 1)
        inside = sum(left - entered for entered, left in calls)
        self.host_seconds.append((cpu - inside) / (steps + 1))  # per call, the prefill's included
        return seconds / steps, out.tokens[0].tolist(), self.prefill_seconds


@contextlib.contextmanager
def _runs_timed():
    """Within the block, every ``run_with_iobinding`` of onnxruntime's sessions records (its calling thread's CPU time
    on entering, on leaving) in the list yielded: what a loop's thread spends outside the runs is the rest."""
    import onnxruntime

    run, calls = onnxruntime.InferenceSession.run_with_iobinding, []

    def timed_run(session, *args):
        entered = time.thread_time()
        try:
            return run(session, *args)
        finally:
            calls.append((entered, time.thread_time()))

    onnxruntime.InferenceSession.run_with_iobinding = timed_run
    try:
        yield calls
    finally:
        onnxruntime.InferenceSession.run_with_iobinding = run


class EngineLoop:
    """The serving engine (``serving.engine.GenerationEngine``) as ``serve`` runs it behind its HTTP routes, in this
    process: one greedy request at a time; the time to its first token counted as the prefill, then the time between
    its token events. Host time: the engine thread's CPU time between two of onnxruntime's runs, the mean."""

    def __init__(self, path: Path, threads: int):
        from mha_deploy.runtime.kv_stepper import KVCacheStepper
        from mha_deploy.serving.engine import GenerationEngine

        self.engine = GenerationEngine(KVCacheStepper(str(path), threads=threads))
        self.engine.start()
        self.host_seconds: list[float] = []

    def decode(self, prompt: np.ndarray, new: int) -> tuple[float, list[int], float]:
        import threading

        from mha_deploy.runtime.generation import GenerationConfig
        from mha_deploy.serving.engine import GenerationRequest

        events, done = [], threading.Event()

        def heard(event) -> None:
            events.append((time.perf_counter(), event.token))
            if event.finish_reason:
                done.set()

        # Timed from before the request starts: its cohort's prepared step takes the run method as it is then.
        with _runs_timed() as calls:
            submitted = time.perf_counter()
            config = GenerationConfig(max_new_tokens=new, eos_token_id=[])
            self.engine.submit(GenerationRequest(prompt[0].astype(np.int64), config), heard)
            done.wait()
        gaps = [after[0] - before[1] for before, after in itertools.pairwise(calls)]
        self.host_seconds.append(statistics.mean(gaps) if gaps else 0.0)
        times = [moment for moment, _ in events]
        return (times[-1] - times[0]) / max(new - 1, 1), [token for _, token in events], times[0] - submitted


class GenaiLoop:
    """onnxruntime-genai's own C++ loop on a folder (greedy, no stop before ``new`` tokens); its prompt's forward
    (``append_tokens``) timed apart, as the other loops' prefill."""

    def __init__(self, folder: Path):
        import onnxruntime_genai

        self.og = onnxruntime_genai
        self.model = onnxruntime_genai.Model(str(folder))

    def decode(self, prompt: np.ndarray, new: int) -> tuple[float, list[int], float]:
        length = prompt.shape[1] + new
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=length, min_length=length, do_sample=False, batch_size=1)
        generator = self.og.Generator(self.model, params)
        started = time.perf_counter()
        generator.append_tokens(prompt.astype(np.int32))
        prefill = time.perf_counter() - started
        started = time.perf_counter()  # the first new token comes from the prompt's logits: new - 1 forwards follow
        while not generator.is_done():
            generator.generate_next_token()
        seconds = time.perf_counter() - started
        return seconds / max(new - 1, 1), [int(t) for t in generator.get_sequence(0)[prompt.shape[1]:]], prefill


def profile_step(path: Path, threads: int, prompt: np.ndarray, new: int, steps: int = 16) -> dict[str, float]:
    """{op type: ms} of a decode step at cache length len(prompt) + new, by onnxruntime's profiler: the
    kernel time of each node in the last ``steps`` runs, summed by op type and averaged per step."""
    loop = PlainLoop(path, threads, profile=True)
    _, caches = loop.prefill(prompt)
    for step in range(max(new - 1, steps)):
        length = prompt.shape[1] + step + 1
        _, caches = loop.run(loop.feeds(np.array([[5]], np.int64), length, caches))
    events = json.loads(Path(loop.session.end_profiling()).read_text())
    runs = [e for e in events if e.get("name") == "model_run"]
    first = runs[-steps]["ts"]
    by_op = defaultdict(float)
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and event["ts"] >= first:
            by_op[event["args"]["op_name"]] += event["dur"] / 1e3 / steps
    return dict(by_op)


def _symmetric(fp32: Path) -> Path:
    """``fp32`` quantized as ``--quantize int4 --quantize-embeddings --symmetric`` would (kept beside this run's
    temporary files; the quality budget is not what this measures: the random weights fail it either way)."""
    import onnx

    from mha_deploy.exporters.quantize import Quantization

    path = Path(tempfile.mkdtemp()) / "sym.onnx"
    onnx.save(Quantization("int4", symmetric=True, embeddings=True).apply(onnx.load(str(fp32))), str(path))
    return path


if __name__ == "__main__":
    main()
