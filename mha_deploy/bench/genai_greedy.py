"""Greedy generation in onnxruntime-genai, as a script run by ``.venv-genai``'s python (``bench.genai``): that
environment has onnxruntime-genai and its own onnxruntime, and no mha-deploy, so this file imports neither
mha-deploy nor anything but onnxruntime-genai and numpy, inside ``main``.

    python genai_greedy.py REQUEST.json   ->   one JSON line on stdout

REQUEST: ``{"model_dir", "prompts": [[ids]] (right-padded with the config's pad id, as onnxruntime-genai pads),
"max_length": prompt width + new tokens, "repeats": how many timed runs, "warmup": one untimed run of two new
tokens first}``. Reply: ``{"sequences": each row of
the last run (prompt, padding and new tokens), "seconds": each run's wall time from the prompt to the last
token, "peak_rss_mb": this process's peak resident memory}``.
"""

import json
import sys
import time


def main(request_path: str) -> None:
    import numpy as np
    import onnxruntime_genai as og

    with open(request_path) as file:
        request = json.load(file)
    model = og.Model(request["model_dir"])
    prompts = np.asarray(request["prompts"], np.int32)
    if request.get("warmup"):
        _greedy(og, model, prompts, prompts.shape[1] + 2)
    seconds, sequences = [], []
    for _ in range(request.get("repeats", 1)):
        start = time.perf_counter()
        sequences = _greedy(og, model, prompts, request["max_length"])
        seconds.append(time.perf_counter() - start)
    print(json.dumps({"sequences": sequences, "seconds": seconds, "peak_rss_mb": _peak_rss_mb()}))


def _greedy(og, model, prompts, max_length: int) -> list[list[int]]:
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=max_length, do_sample=False, batch_size=len(prompts))
    generator = og.Generator(model, params)
    generator.append_tokens(prompts)
    while not generator.is_done():
        generator.generate_next_token()
    return [[int(token) for token in generator.get_sequence(row)] for row in range(len(prompts))]


def _peak_rss_mb() -> float:
    # VmHWM belongs to this process; ru_maxrss would carry the parent's peak across fork+exec.
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


if __name__ == "__main__":
    main(sys.argv[1])
