"""Issue 40's target: a Hugging Face folder exported by ``mha-deploy export --hf DIR`` (its defaults) against Optimum
ONNX's export of the same folder (``optimum-cli export onnx``, plain and ``--optimize O2``) run with its ORTModel*
classes, and against torch (transformers, sdpa) on the same weights.

A script, not a test:

    .venv/bin/python benchmarks/hf_vs_optimum.py --workdir runs/  # the target: ~5 min of timing after the exports
    .venv/bin/python benchmarks/hf_vs_optimum.py --quick         # tiny configs: proves it runs (~6 min, shared CPU)

The exports take 4 (quiet) to 13 (load 11 on 2 cores) minutes; a ``--workdir`` keeps them, and the next run at the
same sizes reuses them (``exports.json``).
    .venv/bin/python benchmarks/hf_vs_optimum.py --workloads bert-8x128 --json figures.json

Where Whisper's time goes, from a workdir's exports: each file of ours' pair and Optimum's timed apart (encoder;
decoder calls, Optimum's first decoder apart since it computes the cross keys/values), on this environment's
onnxruntime, and with ``--profile`` ORT's kernel time per op type of each file:
    .venv/bin/python benchmarks/hf_vs_optimum.py --workdir runs/ --split --profile --rounds 3

Where BERT's and ViT's time goes, from a workdir's exports (``--ops``): our file and Optimum -O2's timed in
interleaved rounds on this environment's onnxruntime (one ORT for both), and ORT's kernel milliseconds per call by op
type of each (a profiled session apiece, beside the timed one):
    .venv/bin/python benchmarks/hf_vs_optimum.py --workdir runs/ --ops --workloads bert-1x512 vit-8 --rounds 8

Workloads (random weights, saved with ``save_pretrained``, nothing downloaded; sizes between the models' tiny and
base configs, ``SIZES``):

- ``bert-8x128``: ``BertForSequenceClassification``, 8 rows of 128 tokens, a quarter of each row padded (right);
- ``bert-1x512``: the same model, one row of 512 tokens;
- ``vit-8``: ``ViTForImageClassification``, 8 images of 224x224 (patch 16: 197 tokens);
- ``whisper-8x32``: ``WhisperForConditionalGeneration`` (whisper-tiny's sizes: 4 + 4 layers, d_model 384, vocabulary
  51,865, 80 mel bins x 3000 frames), greedy generation of 32 new tokens for 8 items from the decoder start id. Its
  generation config suppresses the eos id, so that every row of every system generates exactly 32 tokens.

Rows: ``ours`` (``export --hf DIR``; ``--kv-cache`` for Whisper; run with ``MHASession`` or, for Whisper,
``generate`` over ``KVCacheStepper``), ``optimum`` and ``optimum -O2`` (``optimum-cli export onnx [--optimize O2]``;
``ORTModelForSequenceClassification`` / ``ORTModelForImageClassification`` / ``ORTModelForSpeechSeq2Seq`` and its
``generate``), ``torch`` (the folder's model, sdpa attention, ``generate`` for Whisper). Every ONNX Runtime session
and torch run on the same number of threads (``--threads``, 2). Optimum pins its own transformers and onnxruntime,
so it lives in ``.venv-optimum`` (created on first use: ``optimum-onnx[onnxruntime]`` with torch pinned to this
environment's version, or pip would fetch a CUDA build); its rows run in one worker process there (this file run
with ``--worker``), which loads each model once and times it on request. Timing: rounds in which every row runs
``--calls`` calls in turn, interleaved so that the machine's load falls on every row alike; the median call is
reported. Each row's outputs are compared with torch's (logits: max abs difference; Whisper: the tokens), so that
every row did the same work. A row that fails says why, and the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OPTIMUM_VENV = ROOT / ".venv-optimum"
# pip would take a CUDA build of torch without the pin; the version is this environment's (a local +cpu build).
OPTIMUM_PACKAGES = ("optimum-onnx[onnxruntime]",)
OURS, OPTIMUM, OPTIMUM_O2, TORCH = "ours", "optimum", "optimum -O2", "torch"
ROWS = (OURS, OPTIMUM, OPTIMUM_O2, TORCH)
# The issue's targets: ours' throughput over each row's, per workload.
TARGETS = {"bert-8x128": {OPTIMUM_O2: 1.2}, "bert-1x512": {OPTIMUM_O2: 1.2}, "vit-8": {OPTIMUM_O2: 1.2},
           "whisper-8x32": {OPTIMUM: 1.5, TORCH: 3.0}}
WORKLOADS = tuple(TARGETS)
MODEL_OF = {"bert-8x128": "bert", "bert-1x512": "bert", "vit-8": "vit", "whisper-8x32": "whisper"}
TASKS = {"bert": "text-classification", "vit": "image-classification",
         "whisper": "automatic-speech-recognition-with-past"}
ORT_CLASSES = {"bert": "ORTModelForSequenceClassification", "vit": "ORTModelForImageClassification",
               "whisper": "ORTModelForSpeechSeq2Seq"}
SIZES = {
    "bert": {"layers": 6, "d_model": 512, "heads": 8, "ffn": 2048, "vocab": 30522, "positions": 512},
    "vit": {"layers": 6, "d_model": 384, "heads": 6, "ffn": 1536, "image": 224, "patch": 16},
    "whisper": {"layers": 4, "d_model": 384, "heads": 6, "ffn": 1536, "vocab": 51865, "mel": 80,
                "source_positions": 1500, "target_positions": 448},
}
QUICK_SIZES = {
    "bert": {"layers": 2, "d_model": 64, "heads": 4, "ffn": 128, "vocab": 1000, "positions": 512},
    "vit": {"layers": 2, "d_model": 64, "heads": 4, "ffn": 128, "image": 224, "patch": 16},
    # Optimum's Whisper export traces 3000 frames whatever the config says: a quick run keeps them
    "whisper": {"layers": 2, "d_model": 64, "heads": 4, "ffn": 128, "vocab": 1000, "mel": 80,
                "source_positions": 1500, "target_positions": 64},
}
SHAPES = {"bert-8x128": (8, 128), "bert-1x512": (1, 512), "vit-8": (8, 224), "whisper-8x32": (8, 32)}
QUICK_SHAPES = {"bert-8x128": (2, 32), "bert-1x512": (1, 64), "vit-8": (2, 224), "whisper-8x32": (2, 4)}
ATTENTION_OPS = ("Attention", "MultiHeadAttention", "GroupQueryAttention", "Softmax")
PADDED = 0.25  # of each row of bert-8x128, on the right
NUM_LABELS = 3
START, EOS, PAD = 50258, 50257, 50257  # whisper's <|startoftranscript|> and <|endoftext|>


# --- the Optimum worker (runs in .venv-optimum: numpy, torch, transformers, optimum; no mha_deploy) ----------------


def worker() -> None:
    """Answer JSON requests, one per line on stdin, on the original stdout (everything else printed goes to
    stderr): ``load`` a row's model, ``time`` it (per-call seconds), ``quit``."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # libraries' prints must not corrupt the replies
    models = {}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "quit":
                break
            if request["op"] == "load":
                models[request["key"]] = RUNNERS[request["row"]](request)
                reply = {"ok": True}
            else:
                runner = models[request["key"]]
                seconds = []
                for _ in range(request["calls"]):
                    started = time.perf_counter()
                    result = runner()
                    seconds.append(time.perf_counter() - started)
                if request.get("save"):
                    np.save(request["save"], result)
                reply = {"ok": True, "seconds": seconds}
        except Exception as exc:  # the parent reports it on the row and goes on
            reply = {"ok": False, "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"}
        out.write(json.dumps(reply) + "\n")


def optimum_runner(request: dict):
    """One call of the workload on Optimum's ORTModel of ``request['path']`` (in .venv-optimum); each runner returns
    the outputs compared across rows (logits, or the generated tokens)."""
    import onnxruntime
    import optimum.onnxruntime as ortmodels
    import torch

    torch.set_num_threads(request["threads"])
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = request["threads"], 1
    cls = getattr(ortmodels, ORT_CLASSES[request["model"]])
    model = cls.from_pretrained(request["path"], session_options=options, provider="CPUExecutionProvider")
    return _hf_call(model, request, torch)


def torch_runner(request: dict):
    """The folder's model in torch (sdpa attention, transformers' default)."""
    import torch
    import transformers

    torch.set_num_threads(request["threads"])
    config = transformers.AutoConfig.from_pretrained(request["path"])
    cls = getattr(transformers, config.architectures[0])
    return _hf_call(cls.from_pretrained(request["path"], attn_implementation="sdpa").eval(), request, torch)


def _hf_call(model, request: dict, torch):
    feeds = {name: torch.from_numpy(value) for name, value in np.load(request["inputs"]).items()}
    if request["model"] == "whisper":
        return lambda: _greedy(model, feeds, request["new_tokens"], torch).numpy()

    def run():
        with torch.inference_mode():
            return model(**feeds).logits.numpy()

    return run


def ours_runner(request: dict):
    """The file ``export --hf`` wrote, on mha-deploy's runtime: ``MHASession``, or ``generate`` for Whisper."""
    feeds = dict(np.load(request["inputs"]))
    if request["model"] == "whisper":
        from mha_deploy.runtime.generation import generate
        from mha_deploy.runtime.kv_stepper import KVCacheStepper

        stepper = KVCacheStepper(request["path"], threads=request["threads"])
        features = feeds["input_features"]
        return lambda: np.asarray(generate(stepper, features, max_new_tokens=request["new_tokens"]).tokens)
    from mha_deploy.runtime import MHASession

    session = MHASession(request["path"], provider="cpu", threads=request["threads"])
    names = set(session.signature.input_names)
    # mha-deploy files take bool padding masks (True = real): a tokenizer's 0/1 as bool
    ours = {name: (value.astype(bool) if name == "attention_mask" else value) for name, value in feeds.items()
            if name in names}
    return lambda: session.run(ours)["logits"]


def _greedy(model, feeds: dict, new_tokens: int, torch):
    """Whisper's greedy generation as its users call it (``model.generate``), the new tokens [batch, new_tokens]."""
    with torch.inference_mode():
        tokens = model.generate(feeds["input_features"], max_new_tokens=new_tokens, do_sample=False, num_beams=1)
    return tokens[:, -new_tokens:]


RUNNERS = {OURS: ours_runner, OPTIMUM: optimum_runner, OPTIMUM_O2: optimum_runner, TORCH: torch_runner}


class Worker:
    """One row's worker process (Optimum's in .venv-optimum, the others in this environment), driven line by
    line: each row in a process of its own, so that no row's threads (ORT's spin after a run) slow another's."""

    def __init__(self, python: Path, log: Path):
        self.log = open(log, "w")  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen([str(python), __file__, "--worker"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                        bufsize=1)

    def ask(self, **request) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker ended (its log: {self.log.name})")
        return json.loads(line)

    def close(self) -> None:
        if self.process.poll() is None:
            self.ask_quit()
        self.process.wait(timeout=60)
        self.log.close()

    def ask_quit(self) -> None:
        self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.process.stdin.close()


# --- the harness (this environment: mha_deploy, torch, transformers 5) ----------------------------------------------


def ensure_optimum_venv() -> str:
    """Create ``.venv-optimum`` on first use; return what it holds."""
    python = OPTIMUM_VENV / "bin" / "python"
    check = "import optimum.onnxruntime, onnxruntime, transformers, torch"
    if not python.exists() or subprocess.run([str(python), "-c", check], capture_output=True).returncode != 0:
        import torch

        print(f"creating {OPTIMUM_VENV.name} (optimum-onnx, torch=={torch.__version__.split('+')[0]})", flush=True)
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(OPTIMUM_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", *OPTIMUM_PACKAGES,
                        f"torch=={torch.__version__.split('+')[0]}"], check=True)
    versions = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(', '.join(f'{p} {m.version(p)}' for p in "
         "('optimum-onnx', 'optimum', 'transformers', 'onnxruntime', 'torch')))"],
        capture_output=True, text=True, check=True)
    return versions.stdout.strip()


def save_folder(model: str, sizes: dict, folder: Path) -> None:
    """The model of ``model`` with random weights (seeded), saved with save_pretrained."""
    import torch
    import transformers

    torch.manual_seed(0)
    if model == "bert":
        config = transformers.BertConfig(
            vocab_size=sizes["vocab"], hidden_size=sizes["d_model"], num_hidden_layers=sizes["layers"],
            num_attention_heads=sizes["heads"], intermediate_size=sizes["ffn"],
            max_position_embeddings=sizes["positions"], pad_token_id=0, num_labels=NUM_LABELS)
        module = transformers.BertForSequenceClassification(config)
    elif model == "vit":
        config = transformers.ViTConfig(
            hidden_size=sizes["d_model"], num_hidden_layers=sizes["layers"], num_attention_heads=sizes["heads"],
            intermediate_size=sizes["ffn"], image_size=sizes["image"], patch_size=sizes["patch"],
            num_labels=NUM_LABELS)
        module = transformers.ViTForImageClassification(config)
    else:
        config = transformers.WhisperConfig(
            vocab_size=sizes["vocab"], d_model=sizes["d_model"], encoder_layers=sizes["layers"],
            decoder_layers=sizes["layers"], encoder_attention_heads=sizes["heads"],
            decoder_attention_heads=sizes["heads"], encoder_ffn_dim=sizes["ffn"], decoder_ffn_dim=sizes["ffn"],
            num_mel_bins=sizes["mel"], max_source_positions=sizes["source_positions"],
            max_target_positions=sizes["target_positions"], pad_token_id=_id(PAD, sizes),
            bos_token_id=_id(EOS, sizes), eos_token_id=_id(EOS, sizes), decoder_start_token_id=_id(START, sizes))
        module = transformers.WhisperForConditionalGeneration(config)
        generation = module.generation_config
        # eos suppressed: every row generates exactly the new tokens asked for, in every system
        generation.suppress_tokens, generation.begin_suppress_tokens = [_id(EOS, sizes)], [_id(EOS, sizes)]
        generation.forced_decoder_ids = None
    module.eval().save_pretrained(folder)


def _id(token: int, sizes: dict) -> int:
    """Whisper's special ids, moved into a quick run's small vocabulary."""
    return token if token < sizes["vocab"] else sizes["vocab"] - (50259 - token)


def make_inputs(workload: str, shape: tuple[int, int], sizes: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Hugging Face's input names -> the workload's values (masks int64 0/1, as a tokenizer gives them)."""
    rng = np.random.default_rng(seed)
    model = MODEL_OF[workload]
    if model == "bert":
        batch, seq = shape
        real = seq - int(seq * PADDED) if batch > 1 else seq
        mask = (np.arange(seq)[None, :] < real).repeat(batch, 0).astype(np.int64)
        ids = np.where(mask == 1, rng.integers(3, sizes["vocab"], (batch, seq)), 0).astype(np.int64)
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
    if model == "vit":
        batch, size = shape
        return {"pixel_values": rng.standard_normal((batch, 3, size, size)).astype(np.float32)}
    batch = shape[0]
    frames = 2 * sizes["source_positions"]
    return {"input_features": rng.standard_normal((batch, sizes["mel"], frames)).astype(np.float32)}


def export_ours(folder: Path, model: str, out: Path) -> dict:
    from mha_deploy.exporters.hf_folder import export_hf_folder

    started = time.perf_counter()
    export_hf_folder(folder, out / "model.onnx", kv_cache=model == "whisper")
    return {"path": str(out / "model.onnx"), "seconds": time.perf_counter() - started,
            "attention_ops": _attention_ops(out)}


def export_optimum(folder: Path, model: str, out: Path, optimize: bool) -> dict:
    """``optimum-cli export onnx`` of ``folder`` into ``out``: the path, or the error."""
    cli = OPTIMUM_VENV / "bin" / "optimum-cli"
    command = [str(cli), "export", "onnx", "-m", str(folder), "--task", TASKS[model],
               *(["--optimize", "O2"] if optimize else []), str(out)]
    started = time.perf_counter()
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        lines = [line for line in (run.stderr + run.stdout).splitlines() if line.strip()]
        return {"error": (lines[-1] if lines else f"exit {run.returncode}")[:300],
                "command": " ".join(command[1:])}
    return {"path": str(out), "seconds": time.perf_counter() - started, "command": " ".join(command[1:]),
            "attention_ops": _attention_ops(out)}


def _attention_ops(folder: Path) -> dict[str, dict[str, int]]:
    """Per file of ``folder``: how many attention ops and Softmax it holds (inside If branches too)."""
    from mha_deploy.onnx_nodes import all_nodes
    from mha_deploy.runtime.session_file import read_graph

    counts = {}
    for file in sorted(folder.glob("*.onnx")):
        ops = [node.op_type for node in all_nodes(read_graph(file).graph)]  # op types only: weights left in the file
        counts[file.stem] = {op: ops.count(op) for op in ATTENTION_OPS if op in ops}
    return counts


def export_rows(model: str, sizes: dict, where: Path) -> tuple[Path, dict]:
    """The folder of ``model`` at ``sizes`` and each row's export of it, under ``where``: (folder, row -> {"path"
    | "error", ...}). A ``--workdir`` that holds them from a run at the same sizes (``exports.json``) is reused:
    the exports are most of a run's time."""
    folder, record = where / "hf", where / "exports.json"
    if record.is_file():
        kept = json.loads(record.read_text())
        if kept["sizes"] == sizes and all(Path(row["path"]).exists() for row in kept["rows"].values() if "path" in row):
            print(f"{model}: the folder and exports of {where} reused (same sizes)", flush=True)
            return folder, {row: {**entry, "reused": True} for row, entry in kept["rows"].items()}
    save_folder(model, sizes, folder)
    rows = {}
    for row, make in ((OURS, lambda: export_ours(folder, model, where / "ours")),
                      (OPTIMUM, lambda: export_optimum(folder, model, where / "optimum", False)),
                      (OPTIMUM_O2, lambda: export_optimum(folder, model, where / "optimum-O2", True))):
        try:
            rows[row] = make()
        except Exception as exc:
            rows[row] = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"}
        print(f"{model} {row}: " + (f"exported in {rows[row]['seconds']:.0f} s" if "path" in rows[row]
                                     else f"FAILED {rows[row]['error']}"), flush=True)
    record.write_text(json.dumps({"sizes": sizes, "rows": rows}, indent=2))
    return folder, rows


def measure(args, workdir: Path) -> dict:
    sizes_of, shapes = (QUICK_SIZES, QUICK_SHAPES) if args.quick else (SIZES, SHAPES)
    report = {"threads": args.threads, "quick": args.quick, "load_before": load_average(), "workloads": {},
              "optimum_env": ensure_optimum_venv()}
    models = sorted({MODEL_OF[w] for w in args.workloads}, key=list(SIZES).index)
    exports = {}
    for model in models:
        exports[model] = export_rows(model, sizes_of[model], workdir / model)
    workers = {row: Worker(OPTIMUM_VENV / "bin" / "python" if row in (OPTIMUM, OPTIMUM_O2) else Path(sys.executable),
                           workdir / f"worker-{row.replace(' ', '')}.log") for row in ROWS}
    try:
        for workload in args.workloads:
            report["workloads"][workload] = run_workload(args, workload, sizes_of, shapes, exports, workers,
                                                         workdir)
            print_workload(workload, report["workloads"][workload])  # as it comes: a killed run keeps these
    finally:
        for worker in workers.values():
            worker.close()
    report["load_after"] = load_average()
    return report


def run_workload(args, workload, sizes_of, shapes, exports, workers, workdir) -> dict:
    model = MODEL_OF[workload]
    sizes, shape = sizes_of[model], shapes[workload]
    folder, exported = exports[model]
    inputs = workdir / f"{workload}.npz"
    np.savez(inputs, **make_inputs(workload, shape, sizes))
    new_tokens = shape[1] if model == "whisper" else 0
    runners, result = {}, {"shape": list(shape), "sizes": sizes, "rows": {}}
    for row in ROWS:
        entry = result["rows"][row] = {k: v for k, v in exported.get(row, {}).items() if k != "path"}
        path = str(folder) if row == TORCH else exported[row].get("path")
        if path is None:
            continue
        key = f"{workload}/{row}"
        answer = workers[row].ask(op="load", key=key, row=row, model=model, path=path, inputs=str(inputs),
                                  threads=args.threads, new_tokens=new_tokens)
        if answer["ok"]:
            runners[row] = _Remote(workers[row], key, workdir / f"{workload}-{row.replace(' ', '')}.npy")
        else:
            entry["error"] = answer["error"]
    outputs, seconds = {}, {row: [] for row in runners}
    for row, runner in list(runners.items()):
        try:
            outputs[row] = runner.first()  # also the warm-up call
        except RuntimeError as exc:
            result["rows"][row]["error"] = str(exc)
            del runners[row], seconds[row]
    calls = 1 if model == "whisper" else args.calls  # a Whisper call is seconds: one per round is enough
    for _ in range(args.rounds):
        for row, runner in runners.items():
            seconds[row].extend(runner.times(calls))
    reference = outputs.get(TORCH)
    for row in runners:
        entry = result["rows"][row]
        entry["median_ms"] = float(np.median(seconds[row]) * 1e3)
        entry["calls"] = len(seconds[row])
        if reference is not None and row != TORCH:
            if model == "whisper":
                entry["tokens_equal_torch"] = bool(np.array_equal(outputs[row], reference))
            else:
                entry["max_abs_diff_torch"] = float(np.abs(outputs[row] - reference).max())
    ours = result["rows"].get(OURS, {}).get("median_ms")
    for row in runners:
        if ours and row != OURS:
            result["rows"][row]["ours_speedup"] = result["rows"][row]["median_ms"] / ours
    return result


class _Remote:
    def __init__(self, worker: Worker, key: str, save: Path):
        self.worker, self.key, self.save = worker, key, save

    def first(self):
        answer = self.worker.ask(op="time", key=self.key, calls=1, save=str(self.save))
        if not answer["ok"]:
            raise RuntimeError(answer["error"])
        return np.load(self.save)

    def times(self, calls: int) -> list[float]:
        answer = self.worker.ask(op="time", key=self.key, calls=calls)
        if not answer["ok"]:
            raise RuntimeError(answer["error"])
        return answer["seconds"]


def load_line(before, after, threads: int) -> str:
    """mha_deploy.bench.timing.load_line's words, without importing mha_deploy.bench (which imports torch)."""
    if before is None or after is None:
        return "load average: unknown on this OS"
    text = [" ".join(f"{v:.2f}" for v in load) for load in (before, after)]
    return (f"load average {text[0]} before, {text[1]} after (1/5/15 min; above {threads} means the cores were "
            "shared)")


def load_average():
    try:
        return os.getloadavg()
    except OSError:
        return None


def print_report(report: dict) -> None:
    print(f"\nthreads {report['threads']}{' (quick: tiny configs)' if report['quick'] else ''}; "
          f"Optimum's environment: {report['optimum_env']}")
    for workload, result in report["workloads"].items():
        print_workload(workload, result)
    print("\n" + load_line(report["load_before"], report["load_after"], report["threads"]))


def print_workload(workload: str, result: dict) -> None:
    batch, new = result["shape"]
    unit = f"call ({batch} rows x {new} new tokens)" if workload.startswith("whisper") else "call"
    print(f"\n{workload}: shape {result['shape']}, sizes {result['sizes']}; median ms per {unit}")
    for row in ROWS:
        entry = result["rows"].get(row, {})
        if "median_ms" not in entry:
            print(f"  {row:<12} FAILED: {entry.get('error', 'not run')}")
            continue
        check = ("tokens = torch's" if entry.get("tokens_equal_torch") else "TOKENS DIFFER from torch's"
                 ) if "tokens_equal_torch" in entry else (
            f"max |diff| vs torch {entry['max_abs_diff_torch']:.1e}" if "max_abs_diff_torch" in entry else "")
        speedup = f"ours {entry['ours_speedup']:.2f}x" if "ours_speedup" in entry else ""
        target = TARGETS[workload].get(row)
        verdict = "" if target is None or "ours_speedup" not in entry else (
            f" (target >= {target}x: {'met' if entry['ours_speedup'] >= target else 'NOT met'})")
        print(f"  {row:<12} {entry['median_ms']:9.1f} ms  {speedup:<11}{verdict:<24} {check}")
    for row in (OURS, OPTIMUM, OPTIMUM_O2):
        if "attention_ops" in result["rows"].get(row, {}):
            print(f"  {row} attention ops: {result['rows'][row]['attention_ops']}", flush=True)


# --- where Whisper's time goes (--split): each file of ours and Optimum's pair timed apart ----------------------


def split_whisper(workdir: Path, threads: int, rounds: int, profile: bool = False) -> dict:
    """Ours' encoder file and decoder calls, and Optimum's encoder, first decoder (which computes the cross
    keys/values) and with-past decoder calls, timed apart in interleaved rounds on this environment's onnxruntime
    (one ORT for both, so that the difference is the files'), greedy from the start id on the workload's features;
    with ``profile``, ORT's per-op-type kernel time of one more round per file (``profile_by_op``)."""
    import onnxruntime as ort

    where = workdir / "whisper"
    kept = json.loads((where / "exports.json").read_text())
    exported, sizes = kept["rows"], kept["sizes"]
    shape = (QUICK_SHAPES if sizes == QUICK_SIZES["whisper"] else SHAPES)["whisper-8x32"]
    features = make_inputs("whisper-8x32", shape, sizes)["input_features"]
    new_tokens, start = shape[1], _id(START, sizes)
    ours_dir = Path(exported[OURS]["path"]).parent
    optimum_dir = Path(exported[OPTIMUM]["path"])
    files = {"ours encoder": ours_dir / "model.encoder.onnx", "ours decoder": ours_dir / "model.onnx",
             "optimum encoder": optimum_dir / "encoder_model.onnx",
             "optimum first decoder": optimum_dir / "decoder_model.onnx",
             "optimum decoder with past": optimum_dir / "decoder_with_past_model.onnx"}

    def session(path: Path, prefix: str | None = None):
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        options.log_severity_level = 3
        if prefix:
            options.enable_profiling, options.profile_file_prefix = True, prefix
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def outputs(sess, feeds: dict) -> dict[str, np.ndarray]:
        return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))

    def runs(sessions) -> dict[str, float]:
        """One greedy generation per system: seconds per part, and whether both made the same tokens."""
        seconds, rows = {}, len(features)
        encoder, decoder = sessions["ours encoder"], sessions["ours decoder"]
        started = time.perf_counter()
        cross = {name.replace("present.", "past_key_values.", 1): value
                 for name, value in outputs(encoder, {"input_features": features}).items()}
        seconds["ours encoder"] = time.perf_counter() - started
        past = {port.name: np.zeros((rows, port.shape[1], 0, port.shape[3]), np.float32)
                for port in decoder.get_inputs() if port.name.startswith("past_") and ".encoder." not in port.name}
        ids, ours = np.full((rows, 1), start, np.int64), []
        started = time.perf_counter()
        for step in range(new_tokens):
            out = outputs(decoder, {"input_ids": ids, "attention_mask": np.ones((rows, step + 1), np.int64),
                                    **past, **cross})
            past = {name: out[name.replace("past_key_values.", "present.", 1)] for name in past}
            ids = out["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)
            ours.append(ids)
        seconds["ours decoder"] = time.perf_counter() - started
        started = time.perf_counter()
        hidden = sessions["optimum encoder"].run(None, {"input_features": features})[0]
        seconds["optimum encoder"] = time.perf_counter() - started
        started = time.perf_counter()
        out = outputs(sessions["optimum first decoder"], {"input_ids": np.full((rows, 1), start, np.int64),
                                                          "encoder_hidden_states": hidden})
        seconds["optimum first decoder"] = time.perf_counter() - started
        past = {name.replace("present.", "past_key_values.", 1): value for name, value in out.items()
                if name.startswith("present.")}
        ids = out["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)
        theirs = [ids]
        started = time.perf_counter()
        for _ in range(new_tokens - 1):
            out = outputs(sessions["optimum decoder with past"], {"input_ids": ids, **past})
            past.update({name.replace("present.", "past_key_values.", 1): value for name, value in out.items()
                         if ".decoder." in name})
            ids = out["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)
            theirs.append(ids)
        seconds["optimum decoder with past"] = time.perf_counter() - started
        seconds["tokens equal"] = bool(np.array_equal(np.concatenate(ours, 1), np.concatenate(theirs, 1)))
        return seconds

    sessions = {name: session(path) for name, path in files.items()}
    first = runs(sessions)  # the warm-up, and the tokens compared
    timed = [runs(sessions) for _ in range(rounds)]
    result = {"tokens_equal": first["tokens equal"], "median_ms": {
        name: float(np.median([t[name] for t in timed]) * 1e3) for name in files}}
    if profile:
        prefix = str(workdir / "profile")
        profiled = {name: session(path, f"{prefix}-{name.replace(' ', '-')}") for name, path in files.items()}
        runs(profiled)
        result["profile_ms_per_call"] = {}
        for name, sess in profiled.items():
            events = json.loads(Path(sess.end_profiling()).read_text())
            result["profile_ms_per_call"][name] = profile_by_op(events)
    return result


def profile_by_op(events: list[dict], top: int = 6) -> dict[str, float]:
    """ORT's profile (``SessionOptions.enable_profiling``'s JSON events) as kernel milliseconds per call by op
    type, the ``top`` largest, then "other" and "calls" (the model runs it covers, warm-up included)."""
    calls = sum(1 for e in events if e.get("cat") == "Session" and e.get("name") == "model_run") or 1
    by_op: dict[str, float] = {}
    for event in events:
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            op = event["args"]["op_name"]
            by_op[op] = by_op.get(op, 0.0) + event["dur"] / 1e3 / calls
    ranked = sorted(by_op.items(), key=lambda item: -item[1])
    result = {op: round(ms, 2) for op, ms in ranked[:top]}
    if ranked[top:]:
        result["other"] = round(sum(ms for _, ms in ranked[top:]), 2)
    result["calls"] = calls
    return result


def profile_encoders(workdir: Path, workloads, threads: int, rounds: int) -> dict:
    """Per encoder workload of ``workloads`` whose exports ``workdir`` holds: our file and Optimum -O2's on this
    environment's onnxruntime, with the session options each runs under in the rows (ours: ``MHASession``'s, denormals
    flushed; Optimum's: ORTModel's defaults), timed in interleaved rounds (median ms per call), and ORT's kernel
    milliseconds per call by op type (``profile_by_op`` over every op) from a profiled session of each run beside it.
    An ``If``'s time holds its branch's nodes' (also listed): it is left out of ``kernel_ms``."""
    import onnxruntime as ort

    from mha_deploy.runtime.denormals import ORT_CONFIG_ENTRY

    element = {"tensor(int64)": np.int64, "tensor(bool)": bool, "tensor(float)": np.float32}
    result = {}
    for workload in workloads:
        model = MODEL_OF[workload]
        record = workdir / model / "exports.json"
        if model == "whisper" or not record.is_file():
            continue
        kept = json.loads(record.read_text())
        shape = (QUICK_SHAPES if kept["sizes"] == QUICK_SIZES[model] else SHAPES)[workload]
        inputs = make_inputs(workload, shape, kept["sizes"])
        files = {OURS: Path(kept["rows"][OURS]["path"]), OPTIMUM_O2: Path(kept["rows"][OPTIMUM_O2]["path"]) /
                 "model.onnx"}

        def session(row: str, path: Path, prefix: str | None = None):
            options = ort.SessionOptions()
            options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
            options.log_severity_level = 3
            if row == OURS:
                options.add_session_config_entry(ORT_CONFIG_ENTRY, "1")
            if prefix:
                options.enable_profiling, options.profile_file_prefix = True, prefix
            return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

        timed = {row: session(row, path) for row, path in files.items()}
        profiled = {row: session(row, path, str(workdir / f"profile-{workload}-{row.replace(' ', '')}"))
                    for row, path in files.items()}
        feeds = {row: {port.name: inputs[port.name].astype(element[port.type]) for port in sess.get_inputs()}
                 for row, sess in timed.items()}
        outputs = {row: sess.run(None, feeds[row])[0] for row, sess in timed.items()}  # warm-up
        for row, sess in profiled.items():
            sess.run(None, feeds[row])
        seconds = {row: [] for row in files}
        for _ in range(rounds):
            for row in files:
                started = time.perf_counter()
                timed[row].run(None, feeds[row])
                seconds[row].append(time.perf_counter() - started)
                profiled[row].run(None, feeds[row])
        entry = {"max_abs_diff": float(np.abs(outputs[OURS] - outputs[OPTIMUM_O2]).max()), "rows": {}}
        for row, sess in profiled.items():
            ops = profile_by_op(json.loads(Path(sess.end_profiling()).read_text()), top=1000)
            calls = ops.pop("calls")
            ops.pop("If", None)
            entry["rows"][row] = {"median_ms": float(np.median(seconds[row]) * 1e3), "kernel_ms": ops,
                                  "profiled_calls": calls}
        result[workload] = entry
    return result


def print_ops(profiles: dict) -> None:
    for workload, entry in profiles.items():
        ours, theirs = (entry["rows"][row] for row in (OURS, OPTIMUM_O2))
        print(f"\n{workload} on this environment's onnxruntime: ours {ours['median_ms']:.1f} ms, Optimum -O2 "
              f"{theirs['median_ms']:.1f} ms a call (ours {theirs['median_ms'] / ours['median_ms']:.2f}x); logits "
              f"within {entry['max_abs_diff']:.1e}; kernel ms per call by op type (ours | Optimum -O2):")
        kinds = sorted(set(ours["kernel_ms"]) | set(theirs["kernel_ms"]),
                       key=lambda op: -max(ours["kernel_ms"].get(op, 0), theirs["kernel_ms"].get(op, 0)))
        for op in kinds:
            a, b = ours["kernel_ms"].get(op, 0.0), theirs["kernel_ms"].get(op, 0.0)
            if max(a, b) >= 0.05:
                print(f"  {op:<28} {a:9.2f} {b:9.2f}")
        print(f"  {'all kernels':<28} {sum(ours['kernel_ms'].values()):9.2f} {sum(theirs['kernel_ms'].values()):9.2f}")


def print_split(split: dict) -> None:
    print("\nwhisper-8x32 split (this environment's onnxruntime for every file; median ms per part of one "
          f"generation; tokens {'equal' if split['tokens_equal'] else 'DIFFER'} between the two pairs)")
    ms = split["median_ms"]
    for name, value in ms.items():
        print(f"  {name:<27} {value:9.1f} ms")
    ours = ms["ours encoder"] + ms["ours decoder"]
    theirs = sum(value for name, value in ms.items() if name.startswith("optimum"))
    print(f"  ours {ours:.0f} ms, optimum {theirs:.0f} ms: ours {theirs / ours:.2f}x; encoders alone "
          f"{ms['optimum encoder'] / ms['ours encoder']:.2f}x, decoding (optimum's first decoder included, which "
          f"computes the cross keys/values) {(theirs - ms['optimum encoder']) / ms['ours decoder']:.2f}x")
    for name, ops in split.get("profile_ms_per_call", {}).items():
        print(f"  profile {name} (kernel ms per call): {ops}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny configs and shapes: proves the script runs")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5, quick 2)")
    parser.add_argument("--calls", type=int, default=None,
                        help="calls per row per round (default 2, quick 1; Whisper 1)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the folders and files here")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    parser.add_argument("--split", action="store_true",
                        help="whisper-8x32 only, from a --workdir's exports: time each file of ours' and Optimum's "
                             "pair apart (encoder, decoder calls) instead of the rows")
    parser.add_argument("--profile", action="store_true",
                        help="with --split: also ORT's kernel time per op type of each file")
    parser.add_argument("--ops", action="store_true",
                        help="BERT and ViT workloads, from a --workdir's exports: our file and Optimum -O2's timed "
                             "on this environment's onnxruntime, and ORT's kernel time per op type of each")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker()
        return
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.calls = args.calls or (1 if args.quick else 2)
    if args.ops:
        if args.workdir is None:
            parser.error("--ops reads the exports of a --workdir that a run left")
        before = load_average()
        profiles = profile_encoders(args.workdir, args.workloads, args.threads, args.rounds)
        if not profiles:
            parser.error(f"{args.workdir} holds no BERT or ViT exports of the workloads asked for")
        print_ops(profiles)
        print("\n" + load_line(before, load_average(), args.threads))
        if args.json is not None:
            args.json.write_text(json.dumps(profiles, indent=2))
        return
    if args.split:
        if args.workdir is None or not (args.workdir / "whisper" / "exports.json").is_file():
            parser.error("--split reads the Whisper exports of a --workdir that a run (--workloads whisper-8x32) left")
        before = load_average()
        split = split_whisper(args.workdir, args.threads, args.rounds, profile=args.profile)
        print_split(split)
        print("\n" + load_line(before, load_average(), args.threads))
        if args.json is not None:
            args.json.write_text(json.dumps(split, indent=2))
        return
    import tempfile

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hf-vs-optimum-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        report = measure(args, workdir)
    report["seconds"] = time.perf_counter() - started
    print_report(report)
    print(f"took {report['seconds']:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
