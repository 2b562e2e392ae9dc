"""What ORT's CPU kernels make of causality: each attention op alone, one session each, one run.

A script, not a test:

    .venv/bin/python benchmarks/causal_kernels.py                  # (1,4096), ~1 min on 2 cores
    .venv/bin/python benchmarks/causal_kernels.py --shape 1x1024 --chunks 2,4

Rows (fp32, 8 heads of 64, 2 threads, q/k/v given as [batch, seq, 512]):
- MultiHeadAttention without mask: ORT's flash kernel, the yardstick (all seq² pairs);
- GroupQueryAttention without present outputs: its materialising path;
- GroupQueryAttention with them: its tiled path (what the export runs on long sequences);
- the same, queries cut into N chunks in the graph, chunk c reading the keys before it as past_key/past_value
  (BNSH): the work a causal kernel could skip, made explicit. Each chunked output is checked against the
  unchunked one.

Denormals are flushed to zero as ``MHASession`` does (``mha_deploy.runtime.denormals``): on the pool
threads and around each call; ``--keep-denormals`` runs ORT's default, where the masked probabilities of
the causal ops come out as denormals and every multiply-add on them is slow.

"ns/pair" divides the time by batch × heads × the (query, key) pairs the row must compute: seq² for
MultiHeadAttention, seq(seq+1)/2 for the causal rows. A kernel that skipped the masked half at the same
cost per pair as the flash kernel would show the same ns/pair.
"""

from __future__ import annotations

import argparse

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from mha_deploy.bench import QuietGate
from mha_deploy.bench.timing import time_blocks
from mha_deploy.runtime.denormals import ORT_CONFIG_ENTRY, flushing_denormals

HEADS, HEAD_SIZE = 8, 64
HIDDEN = HEADS * HEAD_SIZE


FLUSH_DENORMALS = True  # main() sets it from --keep-denormals before any session exists


def _session(nodes, initializers, threads: int) -> ort.InferenceSession:
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", "seq", HIDDEN]) for name in "qkv"]
    output = helper.make_tensor_value_info("o", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "attention", inputs, [output], initializer=initializers)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    # Idle threads of one session must not spin while the next one is timed.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry(ORT_CONFIG_ENTRY, "1" if FLUSH_DENORMALS else "0")
    with flushing_denormals(FLUSH_DENORMALS):  # ORT's first load sets the loading thread's mode for good
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _gqa(inputs, outputs, name=""):
    return helper.make_node(
        "GroupQueryAttention", inputs, outputs, domain="com.microsoft", num_heads=HEADS, kv_num_heads=HEADS, name=name
    )


def _chunked_gqa(batch: int, seq: int, chunks: int, threads: int) -> ort.InferenceSession:
    """Causal attention as ``chunks`` GroupQueryAttention ops on the tiled path, chunk c's past the keys before it."""
    size = seq // chunks
    tensors = [
        helper.make_tensor("heads_shape", TensorProto.INT64, [4], [batch, seq, HEADS, HEAD_SIZE]),
        helper.make_tensor("axis1", TensorProto.INT64, [1], [1]),
        helper.make_tensor("axis2", TensorProto.INT64, [1], [2]),
        helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
    ]
    nodes = []
    for x in "kv":  # [batch, seq, hidden] -> BNSH, the layout GQA's past takes
        nodes += [
            helper.make_node("Reshape", [x, "heads_shape"], [f"{x}_heads"]),
            helper.make_node("Transpose", [f"{x}_heads"], [f"{x}_bnsh"], perm=[0, 2, 1, 3]),
        ]
    outputs = []
    for c in range(chunks):
        start, end, total = c * size, (c + 1) * size, (c + 1) * size
        tensors += [
            helper.make_tensor(f"start{c}", TensorProto.INT64, [1], [start]),
            helper.make_tensor(f"end{c}", TensorProto.INT64, [1], [end]),
            helper.make_tensor(f"seqlens{c}", TensorProto.INT32, [batch], [total - 1] * batch),
            helper.make_tensor(f"total{c}", TensorProto.INT32, [], [total]),
        ]
        nodes += [helper.make_node("Slice", [x, f"start{c}", f"end{c}", "axis1"], [f"{x}{c}"]) for x in "qkv"]
        past = ["", ""]
        if c:
            nodes += [helper.make_node("Slice", [f"{x}_bnsh", "zero", f"start{c}", "axis2"], [f"past_{x}{c}"])
                      for x in "kv"]
            past = [f"past_k{c}", f"past_v{c}"]
        inputs = [f"q{c}", f"k{c}", f"v{c}", *past, f"seqlens{c}", f"total{c}"]
        nodes.append(_gqa(inputs, [f"o{c}", f"present_k{c}", f"present_v{c}"]))
        outputs.append(f"o{c}")
    nodes.append(helper.make_node("Concat", outputs, ["o"], axis=1))
    return _session(nodes, tensors, threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1x4096", help="BATCHxSEQ")
    parser.add_argument("--chunks", default="2,4,8", help="query chunk counts for the chunked rows ('' for none)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=6.0, help="timing budget per row")
    parser.add_argument("--quiet-wait-s", type=float, default=15.0)
    parser.add_argument("--keep-denormals", action="store_true", help="ORT's default: denormals not flushed")
    args = parser.parse_args()
    global FLUSH_DENORMALS
    FLUSH_DENORMALS = not args.keep_denormals
    batch, seq = (int(v) for v in args.shape.lower().split("x"))
    chunk_counts = [int(n) for n in args.chunks.split(",") if n]
    if any(seq % n for n in chunk_counts):
        parser.error(f"every chunk count must divide seq {seq}")

    lengths = [
        helper.make_tensor("seqlens", TensorProto.INT32, [batch], [seq - 1] * batch),
        helper.make_tensor("total", TensorProto.INT32, [], [seq]),
    ]
    gqa_inputs = ["q", "k", "v", "", "", "seqlens", "total"]
    mha = helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["o"], domain="com.microsoft", num_heads=HEADS)
    sessions = {
        "MultiHeadAttention, no mask (flash)": _session([mha], [], args.threads),
        "GroupQueryAttention, materialising": _session([_gqa(gqa_inputs, ["o"])], lengths, args.threads),
        "GroupQueryAttention, tiled": _session([_gqa(gqa_inputs, ["o", "pk", "pv"])], lengths, args.threads),
    }
    for n in chunk_counts:
        sessions[f"GroupQueryAttention, tiled, {n} query chunks"] = _chunked_gqa(batch, seq, n, args.threads)

    rng = np.random.default_rng(0)
    feeds = {x: rng.standard_normal((batch, seq, HIDDEN), dtype=np.float32) for x in "qkv"}
    reference = sessions["GroupQueryAttention, tiled"].run(None, feeds)[0]
    for label, session in sessions.items():
        if "chunks" in label or "materialising" in label:
            diff = float(np.abs(session.run(None, feeds)[0] - reference).max())
            print(f"{label}: max abs diff from the tiled op {diff:.1e}")

    gate = QuietGate(wait_s=args.quiet_wait_s)
    def call(session: ort.InferenceSession) -> None:
        with flushing_denormals(FLUSH_DENORMALS):
            session.run(None, feeds)

    calls = {label: (lambda s=session: call(s)) for label, session in sessions.items()}
    timings = time_blocks(calls, args.budget_s * len(calls), gate=gate)
    flash_ms = timings["MultiHeadAttention, no mask (flash)"].median_ms
    flushed = "denormals flushed" if FLUSH_DENORMALS else "denormals kept"
    setting = f"{HEADS} heads of {HEAD_SIZE}, fp32, {args.threads} threads, ORT {ort.__version__}, {flushed}"
    print(f"\nop alone at ({batch},{seq}), {setting}")
    print(f"{'':48s} {'median ms':>10s} {'vs flash':>9s} {'ns/pair':>8s}")
    for label, timing in timings.items():
        pairs = batch * HEADS * (seq * seq if label.startswith("MultiHead") else seq * (seq + 1) / 2)
        ms = timing.median_ms
        print(f"{label:48s} {ms:10.1f} {ms / flash_ms:8.2f}x {ms * 1e6 / pairs:8.2f}")
    print(gate.summary())


if __name__ == "__main__":
    main()
