"""A Hugging Face Llama through mha-deploy against onnxruntime-genai's model builder, the targets of issues 37 (fp32)
and 39 (int4), with transformers' ``generate`` as the reference row.

A script, not a test:

    .venv/bin/python benchmarks/llm_builder.py                # the targets' sizes, fp32 and int4 (~10 min quiet)
    .venv/bin/python benchmarks/llm_builder.py --only fp32    # or int4: one precision's two files
    .venv/bin/python benchmarks/llm_builder.py --quick        # a tiny Llama, short prompts: checks it runs
    .venv/bin/python benchmarks/llm_builder.py --json figures.json
    .venv/bin/python benchmarks/llm_builder.py --workdir DIR  # keeps the folder and files: a rerun measures them

Most of a run is the four exports (mha-deploy's, with its parity checks, take the longest; --quick too): a rerun
with the same ``--workdir`` skips them.

The model: ``LlamaForCausalLM`` from a ``LlamaConfig`` (hidden 512, 6 layers, 8 heads, 2 KV heads, intermediate
1376, 32k vocabulary, 2048 positions; bos 1, eos 2, pad 0), random weights from a fixed seed, written with
``save_pretrained`` into a temporary folder with a word-level tokenizer built locally (``tokenizers``, saved by
``PreTrainedTokenizerFast``): nothing is downloaded. Every tool reads that folder, so every tool has the same
weights:

- mha-deploy: ``mha-deploy export --hf DIR --kv-cache -o F`` (the defaults users get), and with ``--quantize
  int4`` (weight-only MatMulNBits), decoded by ``mha_deploy.runtime.generation.generate``;
- onnxruntime-genai's model builder: ``python -m onnxruntime_genai.models.builder -i DIR -o OUT -p fp32|int4
  -e cpu``, run by onnxruntime-genai (``og.Generator``; the batch through ``GeneratorParams``' batch_size);
- transformers: ``LlamaForCausalLM.from_pretrained(DIR, attn_implementation="sdpa")`` and its ``generate``.

The builder needs torch, transformers and onnx-ir beside onnxruntime-genai: it runs in ``.venv-builder`` (or
``$MHA_DEPLOY_BUILDER_PYTHON``), which the first run creates (a few minutes, ~1.3 GB: python -m venv, then
``pip install onnxruntime-genai==0.18.0 onnx-ir transformers==<.venv's> torch==2.13.0``, the CPU build); the
builder's files are decoded in the same environment. CI never builds it.

Measured, greedy, 2 threads, fp32 CPU, each tool and case in a fresh process of its own (one untimed short run,
then timed runs, median), the cases in turn so that a noisy moment hits every tool of a case alike:

- new tokens/s at batch 1 and at batch 16: prompts of 128 random ids, 128 new tokens (no eos: ours is given
  none, onnxruntime-genai and transformers a minimum length), over the whole generate call, prompt included;
- time to the first token of a 1024-token prompt (batch 1): generating one token, the cache's allocation
  included;
- each process's peak RSS (VmHWM), the files' sizes and their op counts;
- the weight bytes a decoded token reads (every stored weight, an embedding table counted as one row) against
  this machine's memory bandwidth (a numpy sum over 256 MB, one core): at batch 1 their ratio is the limit;
- whether each file's greedy tokens on the first prompt equal transformers' (fp32 should: int4 drifts).

Then the ratios ours / builder per precision and the issues' targets, met or not in this run, and the load
average before and after (above 2 means the cores were shared and the figures are noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from _decode_limits import memory_bandwidth_gb_s, peak_rss_mb, weight_bytes_per_token
from _probe import run_probe, time_our_decoding, time_transformers_decoding

REPOSITORY = Path(__file__).resolve().parents[1]
THREADS, PAD, BOS, EOS = 2, 0, 1, 2
BUILDER_GENAI, BUILDER_TORCH = "0.18.0", "2.13.0"


@dataclass(frozen=True)
class Sizes:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    positions: int
    prompt: int
    new: int
    batch: int
    long_prompt: int  # time to first token's
    repeats: int  # timed runs per generate case (the first token's: twice as many)


# The builder's GroupQueryAttention takes head sizes in multiples of 16 only: QUICK's hidden 128 over 8 heads.
TARGET = Sizes(32000, 512, 6, 8, 2, 1376, 2048, prompt=128, new=128, batch=16, long_prompt=1024, repeats=2)
QUICK = Sizes(512, 128, 2, 8, 2, 256, 256, prompt=16, new=16, batch=4, long_prompt=64, repeats=1)


@dataclass(frozen=True)
class Tool:
    """A row of the report: who decodes (a probe of this script) which file of which precision."""

    label: str
    probe: str  # ours | genai | transformers
    precision: str  # fp32 | int4
    model: Path  # the .onnx file, or the Hugging Face folder for transformers
    options: str = ""  # export options beyond the defaults, and why


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny Llama, short prompts: checks it runs")
    parser.add_argument("--only", choices=("fp32", "int4"), help="one precision's files (default: both)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--workdir", type=Path,
                        help="where the folder and files go, kept (default: a temporary one); a later run with the "
                             "same --workdir measures the files already there instead of exporting again")
    parser.add_argument("--probe", choices=("ours", "genai", "transformers"), help=argparse.SUPPRESS)
    parser.add_argument("--request", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:  # a fresh process measuring one tool on one case (see _probe)
        print(json.dumps(_PROBES[args.probe](json.loads(args.request.read_text()))))
        return
    python = Path(sys.executable)
    shown = os.path.relpath(python) if python.is_relative_to(Path.cwd()) else str(python)
    print("command:", shlex.join([shown, *sys.argv]), flush=True)
    sizes = QUICK if args.quick else TARGET
    precisions = [args.only] if args.only else ["fp32", "int4"]
    if args.workdir is not None:
        workdir = args.workdir / ("quick" if args.quick else "target")
        workdir.mkdir(parents=True, exist_ok=True)
        figures = run(sizes, workdir, precisions)
    else:
        with tempfile.TemporaryDirectory(prefix="mha-llm-builder-bench-") as workdir:
            figures = run(sizes, Path(workdir), precisions)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1))
        print(f"figures written to {args.json}")


def run(sizes: Sizes, workdir: Path, precisions: list[str]) -> dict:
    from mha_deploy.bench import QuietGate
    from mha_deploy.bench.timing import load_average, load_line

    before = load_average()
    started = time.perf_counter()
    gate = QuietGate(wait_s=2.0, total_wait_s=20.0) if sizes is QUICK else QuietGate(wait_s=10.0, total_wait_s=120.0)
    folder = write_llama(sizes, workdir / "llama")
    builder = builder_python()
    tools = []
    for precision in precisions:
        path, options = export_ours(folder, workdir, precision)
        tools.append(Tool(f"mha-deploy {precision}", "ours", precision, path, options))
        tools.append(Tool(f"builder {precision}", "genai", precision, export_builder(builder, folder, workdir,
                                                                                        precision)))
    tools.append(Tool("transformers sdpa", "transformers", "fp32", folder))

    print("files (op counts, subgraphs included):")
    files = {tool.label: {**describe_file(tool.model), "export_options": tool.options}
             for tool in tools if tool.probe != "transformers"}
    for label, file in files.items():
        print(f"  {label:<16} {file['size_mb']:7.1f} MB, {file['nodes']} nodes: "
              + ", ".join(f"{op} {count}" for op, count in file["ops"].items()))
        if file["export_options"]:
            print(f"  {'':<16} {file['export_options']}")
    bandwidth = memory_bandwidth_gb_s()
    print(f"memory bandwidth: {bandwidth:.1f} GB/s (numpy sum over 256 MB, one core, best of 5)", flush=True)

    rng = np.random.default_rng(0)
    prompts = rng.integers(3, sizes.vocab, (sizes.batch, sizes.prompt)).tolist()  # no pad, bos or eos among them
    long_prompt = rng.integers(3, sizes.vocab, (1, sizes.long_prompt)).tolist()
    cases = {"batch 1": (prompts[:1], sizes.new, sizes.repeats + 1),
             f"batch {sizes.batch}": (prompts, sizes.new, sizes.repeats),
             "first token": (long_prompt, 1, 2 * sizes.repeats + 1)}
    results: dict[str, dict[str, dict]] = {tool.label: {} for tool in tools}
    for case, (rows, new, repeats) in cases.items():
        for tool in tools:
            gate.wait()
            request = {"model": str(tool.model), "prompts": rows, "new": new, "repeats": repeats, "threads": THREADS}
            python = builder if tool.probe == "genai" else Path(sys.executable)
            results[tool.label][case] = _probe(python, tool.probe, request, workdir)
        print(f"measured {case}", flush=True)

    figures = report(sizes, tools, files, results, bandwidth, list(cases))
    print(gate.summary())
    after = load_average()
    print(load_line(before, after, THREADS))
    print(f"the run took {time.perf_counter() - started:.0f} s")
    return {"sizes": asdict(sizes), "threads": THREADS, "bandwidth_gb_s": bandwidth, "files": files, **figures,
            "load_before": before, "load_after": after, "gate": gate.summary()}


def report(sizes: Sizes, tools: list[Tool], files: dict, results: dict, bandwidth: float, cases: list[str]) -> dict:
    """The table, the ratios ours / builder, the targets and the tokens' agreement; returns the figures."""
    batch1, batchn, first = cases
    rows = {}
    for tool in tools:
        measured = results[tool.label]
        rows[tool.label] = {
            "tokens_s": {case: len(measured[case]["tokens"]) * len(measured[case]["tokens"][0])
                         / float(np.median(measured[case]["seconds"])) for case in (batch1, batchn)},
            "first_token_s": float(np.median(measured[first]["seconds"])),
            "peak_rss_mb": {case: measured[case]["peak_rss_mb"] for case in cases},
        }
    print(f"\nLlama hidden {sizes.hidden}, {sizes.layers} layers, {sizes.heads} heads, {sizes.kv_heads} KV heads, "
          f"intermediate {sizes.intermediate}, vocabulary {sizes.vocab}; {THREADS} threads, greedy; prompts of "
          f"{sizes.prompt}, {sizes.new} new tokens; first token at a {sizes.long_prompt}-token prompt")
    print(f"{'':<18}{'new tokens/s':>17}  {'first':>7}  {'peak RSS MB':>18}  {'file':>6}  {'weights':>8}  "
          f"{'batch-1 limit':>13}")
    print(f"{'tool':<18}{'batch 1':>8} {batchn:>8}  {'token s':>7}  {'b1':>5} {'b' + batchn[6:]:>5} {'ttft':>6}  "
          f"{'MB':>6}  {'MB/token':>8}  {'tok/s (share)':>13}")
    for tool in tools:
        row = rows[tool.label]
        rss = row["peak_rss_mb"]
        rate = row["tokens_s"][batch1]
        line = (f"{tool.label:<18}{rate:8.0f} {row['tokens_s'][batchn]:8.0f}  {row['first_token_s']:7.3f}  "
                f"{rss[batch1]:5.0f} {rss[batchn]:5.0f} {rss[first]:6.0f}")
        if tool.label in files:
            read = files[tool.label]["weight_bytes_per_token"]
            limit = bandwidth * 1e9 / read
            row["batch1_limit_tokens_s"] = limit
            line += (f"  {files[tool.label]['size_mb']:6.1f}  {read / 2**20:8.1f}  {limit:6.0f} ({rate / limit:4.0%})")
        print(line)
    print(f"(batch-1 limit: {bandwidth:.1f} GB/s of memory bandwidth over the weight bytes a decoded token reads; "
          "the share is the batch-1 rate's fraction of it)")

    ratios = {}
    print("ours / builder (tokens/s: above 1 is faster; first token, RSS and file: below 1 is less):")
    for precision in sorted({tool.precision for tool in tools if tool.probe == "ours"}):
        ours, theirs = rows[f"mha-deploy {precision}"], rows[f"builder {precision}"]
        ratio = {"batch 1": ours["tokens_s"][batch1] / theirs["tokens_s"][batch1],
                 batchn: ours["tokens_s"][batchn] / theirs["tokens_s"][batchn],
                 "first token": ours["first_token_s"] / theirs["first_token_s"],
                 "peak RSS": ours["peak_rss_mb"][batchn] / theirs["peak_rss_mb"][batchn],
                 "file": files[f"mha-deploy {precision}"]["size_mb"] / files[f"builder {precision}"]["size_mb"]}
        ratios[precision] = ratio
        print(f"  {precision}: " + "; ".join(f"{name} {value:.2f}x" for name, value in ratio.items()))

    agreement = tokens_agreement(tools, results, batch1)
    targets = check_targets(rows, files, ratios, batch1, batchn)
    return {"rows": rows, "ratios": ratios, "agreement": agreement, "targets": targets}


def tokens_agreement(tools: list[Tool], results: dict, case: str) -> dict:
    """Per file: how many of its greedy tokens on the first prompt equal transformers', and the first that does
    not."""
    reference = results["transformers sdpa"][case]["tokens"][0]
    agreement = {}
    print(f"greedy tokens on the first prompt against transformers' ({len(reference)} new tokens):")
    for tool in tools:
        if tool.probe == "transformers":
            continue
        tokens = results[tool.label][case]["tokens"][0]
        same = [a == b for a, b in zip(tokens, reference, strict=True)]
        first = same.index(False) if False in same else None
        agreement[tool.label] = {"equal": sum(same), "of": len(same), "first_difference": first}
        words = "identical" if first is None else f"first difference at new token {first}"
        print(f"  {tool.label:<16} {sum(same)}/{len(same)} equal, {words}")
    return agreement


def check_targets(rows: dict, files: dict, ratios: dict, batch1: str, batchn: str) -> dict:
    """Issue 37's fp32 targets and issue 39's int4 ones, each with this run's figure."""
    checks = []
    if "fp32" in ratios:
        fp32 = ratios["fp32"]
        checks += [("37: fp32 batch 1 >= 1.0x the builder's", fp32["batch 1"], ">=", 1.0),
                   (f"37: fp32 {batchn} >= 1.0x the builder's", fp32[batchn], ">=", 1.0),
                   ("37: first token no slower than the builder's (ours / theirs)", fp32["first token"], "<=", 1.0),
                   ("37: peak RSS within 10% of the builder's", fp32["peak RSS"], "<=", 1.1)]
    if "int4" in ratios:
        int4 = ratios["int4"]
        row = rows["mha-deploy int4"]
        checks += [("39: int4 batch 1 >= 1.0x the builder's int4", int4["batch 1"], ">=", 1.0),
                   (f"39: int4 {batchn} >= 1.0x the builder's int4", int4[batchn], ">=", 1.0),
                   ("39: batch 1 within 1.5x of its bandwidth limit (limit / rate)",
                    row["batch1_limit_tokens_s"] / row["tokens_s"][batch1], "<=", 1.5)]
        if "fp32" in ratios:
            checks += [("39: int4 batch 1 >= 3x our fp32",
                        row["tokens_s"][batch1] / rows["mha-deploy fp32"]["tokens_s"][batch1], ">=", 3.0),
                       ("39: int4 file <= 0.3x our fp32 file",
                        files["mha-deploy int4"]["size_mb"] / files["mha-deploy fp32"]["size_mb"], "<=", 0.3)]
    print("targets (this run's own figures):")
    targets = {}
    for words, value, sense, bound in checks:
        met = value >= bound if sense == ">=" else value <= bound
        targets[words] = {"value": value, "met": met}
        print(f"  {words}: {value:.2f}x {'met' if met else 'NOT met'}")
    return targets


def write_llama(sizes: Sizes, folder: Path) -> Path:
    """The benchmark's Llama and a word-level tokenizer of its vocabulary, saved as Hugging Face saves them (kept
    when ``folder`` holds them from an earlier run)."""
    if (folder / "tokenizer_config.json").exists():
        print(f"reusing the Llama in {folder} (written by an earlier run)", flush=True)
        return folder
    import torch
    import transformers
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    config = transformers.LlamaConfig(
        vocab_size=sizes.vocab, hidden_size=sizes.hidden, num_hidden_layers=sizes.layers,
        num_attention_heads=sizes.heads, num_key_value_heads=sizes.kv_heads, intermediate_size=sizes.intermediate,
        max_position_embeddings=sizes.positions, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    words = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, **{f"w{i}": i for i in range(3, sizes.vocab)}}
    word_level = Tokenizer(WordLevel(words, unk_token="<pad>"))
    word_level.pre_tokenizer = Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="<pad>", bos_token="<s>",
                                         eos_token="</s>", unk_token="<pad>").save_pretrained(folder)
    print(f"wrote the Llama ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M weights, seed 0) and its "
          f"tokenizer to {folder}", flush=True)
    return folder


def export_ours(folder: Path, workdir: Path, precision: str) -> tuple[Path, str]:
    """``mha-deploy export --hf`` as a user runs it, with ``--quantize int4`` for int4; and, when the file is not
    that command's, why, in words ("" when it is).

    The export refuses a quantized file whose error against the fp32 module passes its budget; random weights are
    not a trained model's, so then the file measured is the fp32 export quantized the way ``--quantize`` quantizes
    (``Quantization.apply``: the same MatMulNBits, block 32, accuracy_level 4), the refusal printed beside it."""
    path = workdir / f"mha-deploy-{precision}" / "model.onnx"
    record = path.with_name("bench-export.txt")  # how it was made, for a rerun that reuses the file
    if _reused(path):
        return path, record.read_text() if record.exists() else ""
    command = [str(Path(sys.executable).with_name("mha-deploy")), "export", "--hf", str(folder), "--kv-cache"]
    if precision == "fp32":
        _run_tool([*command, "-o", str(path)], "mha-deploy export (fp32)")
        return path, ""
    done = _run_tool([*command, "--quantize", precision, "-o", str(path)], f"mha-deploy export ({precision})",
                     check=False)
    if done.returncode == 0:
        return path, ""
    refused = re.search(r"parity FAILED.*?(relative error [\d.]+% \(budget [\d.]+%)[^)]*\).*?(top-1 agreement [\d.]+%)",
                        done.stdout + done.stderr)
    if refused is None:
        raise SystemExit(f"mha-deploy export ({precision}) failed:\n{(done.stdout + done.stderr)[-3000:]}")
    words = (f"the fp32 export quantized by Quantization({precision!r}).apply: --quantize {precision} refused its "
             f"{refused.group(1)}), {refused.group(2)} against the fp32 module")
    print(f"  {words}", flush=True)
    fp32, _ = export_ours(folder, workdir, "fp32")
    _quantize_file(fp32, path, precision)
    record.write_text(words)
    return path, words


def _quantize_file(fp32: Path, path: Path, precision: str) -> None:
    """``fp32`` quantized as ``--quantize precision`` quantizes, with the metadata's weight-only record that the
    export would have written (the load check's cache probe allows int8 activations' rounding then)."""
    from dataclasses import replace

    import onnx

    from mha_deploy.exporters.quantize import Quantization
    from mha_deploy.metadata import METADATA_KEY, ModelMetadata

    quantization = Quantization(precision)
    model = quantization.apply(onnx.load(str(fp32)))
    props = {prop.key: prop.value for prop in model.metadata_props}
    metadata = replace(ModelMetadata.from_props(props, str(fp32)), quantization=precision,
                       weight_only=quantization.record(model))
    for prop in model.metadata_props:
        if prop.key == METADATA_KEY:
            prop.value = metadata.to_json()
    path.parent.mkdir(parents=True, exist_ok=True)  # the refused export left no folder behind
    onnx.save(model, str(path))


def export_builder(python: Path, folder: Path, workdir: Path, precision: str) -> Path:
    """onnxruntime-genai's model builder for the CPU, then ``THREADS`` intra-op threads in its genai_config.json
    (the builder writes none: ORT would take every core)."""
    out = workdir / f"builder-{precision}"
    if _reused(out / "genai_config.json"):
        return out / "model.onnx"
    command = [str(python), "-m", "onnxruntime_genai.models.builder", "-i", str(folder), "-o", str(out),
               "-p", precision, "-e", "cpu", "-c", str(workdir / "builder-cache")]
    _run_tool(command, f"onnxruntime-genai builder ({precision})")
    config_path = out / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = THREADS
    config_path.write_text(json.dumps(config, indent=4))
    return out / "model.onnx"


def _reused(path: Path) -> bool:
    """Whether ``path`` is there from an earlier run with the same --workdir (then it is measured as it is)."""
    if path.exists():
        print(f"reusing {path.parent} (written by an earlier run: delete it to export again)", flush=True)
    return path.exists()


def _run_tool(command: list[str], name: str, check: bool = True) -> subprocess.CompletedProcess:
    print(f"$ {shlex.join(command)}", flush=True)
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0 and check:
        raise SystemExit(f"{name} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    print(f"  {name}: {'failed' if done.returncode else 'done'} in {time.perf_counter() - started:.0f} s", flush=True)
    return done


def builder_python() -> Path:
    """The python that runs onnxruntime-genai's builder (and decodes its files): ``$MHA_DEPLOY_BUILDER_PYTHON``,
    else ``.venv-builder``, created here on first use (it is kept out of git by a ``.gitignore`` inside it)."""
    given = os.environ.get("MHA_DEPLOY_BUILDER_PYTHON")
    if given:
        return Path(given)
    env = REPOSITORY / ".venv-builder"
    python = env / "bin" / "python"
    if python.exists():
        return python
    from importlib.metadata import version

    packages = [f"onnxruntime-genai=={BUILDER_GENAI}", "onnx-ir", f"transformers=={version('transformers')}",
                f"torch=={BUILDER_TORCH}"]  # pinned: an unpinned torch pulls a multi-GB CUDA build
    print(f"creating {env} for onnxruntime-genai's builder ({', '.join(packages)}): a few minutes, once", flush=True)
    base = getattr(sys, "_base_executable", sys.executable)
    _run_tool([base, "-m", "venv", str(env)], "python -m venv")
    (env / ".gitignore").write_text("*\n")
    _run_tool([str(python), "-m", "pip", "install", "--quiet", *packages], "pip install")
    return python


def describe_file(path: Path) -> dict:
    """Size on disk (external data included), op counts over every graph, and the weight bytes a token reads."""
    import onnx

    from mha_deploy.onnx_nodes import all_nodes

    size = sum(file.stat().st_size for file in path.parent.iterdir()
               if file.name == path.name or file.name.startswith(path.name + ".") or file.suffix == ".data")
    model = onnx.load(str(path), load_external_data=False)
    ops = Counter(node.op_type for node in all_nodes(model.graph))
    return {"size_mb": size / 2**20, "nodes": sum(ops.values()), "ops": dict(ops.most_common()),
            "weight_bytes_per_token": weight_bytes_per_token(path)}


def _probe(python: Path, name: str, request: dict, workdir: Path) -> dict:
    """One tool on one case in a fresh process (this script with --probe), so that its peak RSS is its own."""
    return run_probe(python, __file__, name, request, workdir)


def _ours(request: dict) -> dict:
    """runtime.generation over the file: torch-free, as users run it; no eos, so every row runs to the end."""
    seconds, out, _ = time_our_decoding(request)
    return {"seconds": seconds, "peak_rss_mb": peak_rss_mb(), "tokens": [t.tolist() for t in out.tokens]}


def _genai(request: dict) -> dict:
    """onnxruntime-genai on the builder's folder (in the builder's environment: numpy and onnxruntime-genai only),
    with a minimum length so that no row stops at eos."""
    import onnxruntime_genai as og

    model = og.Model(str(Path(request["model"]).parent))
    prompts = np.asarray(request["prompts"], np.int32)

    def greedy(new: int) -> list[list[int]]:
        length = prompts.shape[1] + new
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=length, min_length=length, do_sample=False, batch_size=len(prompts))
        generator = og.Generator(model, params)
        generator.append_tokens(prompts)
        while not generator.is_done():
            generator.generate_next_token()
        return [list(map(int, generator.get_sequence(row)[prompts.shape[1]:])) for row in range(len(prompts))]

    greedy(2)  # untimed: first-run allocations
    seconds = []
    for _ in range(request["repeats"]):
        started = time.perf_counter()
        tokens = greedy(request["new"])
        seconds.append(time.perf_counter() - started)
    return {"seconds": seconds, "peak_rss_mb": peak_rss_mb(), "tokens": tokens}


def _transformers(request: dict) -> dict:
    """transformers' generate on the folder (sdpa, its own cache), with a minimum length so that no row stops at
    eos."""
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(request["threads"])
    model = LlamaForCausalLM.from_pretrained(request["model"], attn_implementation="sdpa", dtype=torch.float32)
    model.eval()
    seconds, tokens = time_transformers_decoding(model, request, PAD, EOS)
    return {"seconds": seconds, "peak_rss_mb": peak_rss_mb(), "tokens": tokens.tolist()}


_PROBES = {"ours": _ours, "genai": _genai, "transformers": _transformers}


if __name__ == "__main__":
    main()
