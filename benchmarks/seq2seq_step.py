"""What a cached step of a user's encoder-decoder costs: the pair ``export --kv-cache`` writes
(``exporters/own_seq2seq_cache.py``) against recomputing the target through the same decoder file.

A script, not a test:

    .venv/bin/python benchmarks/seq2seq_step.py            # build_bench(): d_model 512, 8 heads, 6 + 6 layers
    .venv/bin/python benchmarks/seq2seq_step.py --quick    # the small tutorial model, short lengths: checks it runs

The model is ``tests/user_models/seq2seq.py``'s tutorial-form encoder-decoder, exported as users export it
(``export_model(module, path, INPUTS, kv_cache=True)``: fused, parity checked call by call). Batch 1, 2 threads,
fp32 CPU, medians: the encoder once over the source; the decoder over the whole target with an empty cache (what
a step costs without a cache, the encoder's keys/values given); one new target token after the others cached.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]


def median_ms(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small tutorial model, short lengths")
    parser.add_argument("--source", type=int, default=128)
    parser.add_argument("--target", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests" / "user_models"))
    import seq2seq

    from mha_deploy.exporters import export_model

    module = seq2seq.build() if args.quick else seq2seq.build_bench()
    source_len, target_len = (6, 9) if args.quick else (args.source, args.target)
    source_vocab, target_vocab = module.src_embed.num_embeddings, module.generator.out_features
    folder = Path(tempfile.mkdtemp(prefix="seq2seq-step-"))
    started = time.perf_counter()
    result = export_model(module, folder / "mt.onnx", seq2seq.INPUTS, kv_cache=True)
    print(f"export {time.perf_counter() - started:.0f} s: {result.fusion.summary()}")
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    encoder, decoder = (ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
                        for path in (result.encoder_path, result.path))
    rng = np.random.default_rng(0)
    source = {"input_ids": rng.integers(0, source_vocab, (1, source_len)),
              "attention_mask": np.ones((1, source_len), bool)}
    encoded = dict(zip([o.name for o in encoder.get_outputs()], encoder.run(None, source), strict=True))
    cross = {name.replace("present.", "past_key_values.", 1): value for name, value in encoded.items()}
    self_caches = [port for port in decoder.get_inputs()
                   if port.name.startswith("past_key_values.") and ".encoder." not in port.name]
    target = rng.integers(0, target_vocab, (1, target_len))
    fixed = {"attention_mask": np.ones((1, target_len), np.int64), "encoder_attention_mask": source["attention_mask"],
             **cross}
    empty = {p.name: np.zeros((1, p.shape[1], 0, p.shape[3]), np.float32) for p in self_caches}
    outputs = [o.name for o in decoder.get_outputs()]

    def whole():
        return dict(zip(outputs, decoder.run(None, {"input_ids": target, **fixed, **empty}), strict=True))

    full = whole()
    past = {p.name: full[p.name.replace("past_key_values.", "present.", 1)][:, :, :-1] for p in self_caches}

    def step():
        return dict(zip(outputs, decoder.run(None, {"input_ids": target[:, -1:], **fixed, **past}), strict=True))

    gap = float(np.abs(step()["logits"][0, -1] - full["logits"][0, -1]).max())
    repeats = 3 if args.quick else 10
    encode_ms = median_ms(lambda: encoder.run(None, source), repeats)
    whole_ms, step_ms = median_ms(whole, repeats), median_ms(step, 5 * repeats)
    print(f"source {source_len}, target {target_len}, batch 1, {args.threads} threads: encoder {encode_ms:.1f} ms "
          f"(once per request); decoder over the whole target {whole_ms:.1f} ms; one token after {target_len - 1} "
          f"cached {step_ms:.2f} ms ({whole_ms / step_ms:.1f}x); step logits vs the whole target's last row: max "
          f"abs diff {gap:.2g}")


if __name__ == "__main__":
    main()
