"""``mha-deploy generate`` and ``batch.generation``: prompts from a dataset through the generation loop over a user's
causal LM exported with ``export --module ... --kv-cache`` (tests/user_models/causal_lm.py), held to the library
loop prompt by prompt; bad prompts, formats, resume after SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from mha_deploy.cli import main
from mha_deploy.runtime.generation import generate
from mha_deploy.runtime.kv_stepper import KVCacheStepper
from tests.conftest import USER_MODELS, user_module

pytest.importorskip("torch")

VOCAB = 50  # TinyLM's
MAX_NEW = 8


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gen") / "lm.onnx"
    inputs = [arg for spec in user_module("causal_lm").INPUTS for arg in ("--input", spec)]
    result = CliRunner().invoke(
        main, ["export", "--module", f"{USER_MODELS / 'causal_lm'}.py:build", *inputs, "--kv-cache",
               "-o", str(path)]
    )
    assert result.exit_code == 0, result.output
    assert KVCacheStepper(path).ragged  # what --kv-cache writes by default
    return path


def prompts(count: int, seed: int, longest: int = 12) -> dict[str, list[int]]:
    rng = np.random.default_rng(seed)
    return {f"p{i}": rng.integers(0, VOCAB, rng.integers(1, longest + 1)).tolist() for i in range(count)}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(*args) -> object:
    return CliRunner().invoke(main, ["generate", *map(str, args), "--no-progress"])


def library_tokens(lm: Path, prompt: list[int], **options) -> list[int]:
    """The library loop on one prompt alone: no batch, no padding."""
    return generate(KVCacheStepper(lm), [prompt], max_new_tokens=MAX_NEW, **options).tokens[0].tolist()


def test_greedy_equals_the_library_loop_prompt_by_prompt(lm, tmp_path):
    given = prompts(7, seed=0)
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": k, "input_ids": v} for k, v in given.items()])
    # TinyLM has no positions: with --pad-prompts, batches of 3 sorted by length mix lengths, padded on the left
    result = run(lm, "--input", source, "--output", tmp_path / "out.jsonl", "--max-new-tokens", MAX_NEW,
                 "--batch-size", 3, "--pad-prompts")
    assert result.exit_code == 0, result.output
    assert "7 prompts, 56 new tokens" in result.stdout and "tokens/s" in result.stdout
    assert "3 batches" in result.stdout
    out = read_jsonl(tmp_path / "out.jsonl")
    assert [r["id"] for r in out] == list(given), "input order"
    for record in out:
        assert set(record) == {"id", "output_ids"}
        assert record["output_ids"] == library_tokens(lm, given[record["id"]]), record["id"]
    # By default too, though the file takes no position_ids: its ragged cache keeps each row at its own length (as
    # serve mixes lengths for it), so batches of 3 mix lengths and each prompt still gets its tokens alone.
    assert len({len(v) for v in given.values()}) > 3, "the prompts no longer have more lengths than batches"
    result = run(lm, "--input", source, "--output", tmp_path / "mixed.jsonl", "--max-new-tokens", MAX_NEW,
                 "--batch-size", 3)
    assert result.exit_code == 0, result.output
    assert "3 batches" in result.stdout
    assert (tmp_path / "mixed.jsonl").read_bytes() == (tmp_path / "out.jsonl").read_bytes()


def test_presence_and_frequency_penalties_batched_equal_the_library_loop(lm, tmp_path):
    given = prompts(5, seed=2)
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": k, "input_ids": v} for k, v in given.items()])
    result = run(lm, "--input", source, "--output", tmp_path / "out.jsonl", "--max-new-tokens", MAX_NEW,
                 "--batch-size", 3, "--pad-prompts", "--presence-penalty", "0.5", "--frequency-penalty", "1.5")
    assert result.exit_code == 0, result.output
    for record in read_jsonl(tmp_path / "out.jsonl"):
        assert record["output_ids"] == library_tokens(lm, given[record["id"]], presence_penalty=0.5,
                                                      frequency_penalty=1.5), record["id"]
    for bad in (["--frequency-penalty", "2.5"], ["--presence-penalty", "1", "--num-beams", "2"]):
        result = run(lm, "--input", source, "--output", tmp_path / "bad.jsonl", *bad)
        assert result.exit_code == 2 and ("penalty" in result.output), result.output


def test_an_end_id_ends_each_prompt_where_it_first_comes(lm, tmp_path):
    given = prompts(6, seed=1)
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": k, "input_ids": v} for k, v in given.items()])
    full = {k: library_tokens(lm, v) for k, v in given.items()}
    eos = full["p0"][2]
    result = run(lm, "--input", source, "--output", tmp_path / "out.jsonl", "--max-new-tokens", MAX_NEW,
                 "--eos-id", eos, "--batch-size", 4)
    assert result.exit_code == 0, result.output
    lengths = set()
    for record in read_jsonl(tmp_path / "out.jsonl"):
        tokens = full[record["id"]]
        expected = tokens[: tokens.index(eos) + 1] if eos in tokens else tokens
        assert record["output_ids"] == expected, record["id"]
        lengths.add(len(expected))
    assert len(lengths) > 1, "rows finished at different steps"


def test_text_prompts_through_a_tokenizer_and_text_out(lm, tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tokenizer = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "w3 w7 w11"}, {"id": 2, "input_ids": [4, 9]}])
    result = run(lm, "--input", source, "--output", tmp_path / "out.jsonl", "--max-new-tokens", MAX_NEW,
                 "--tokenizer", tmp_path / "tokenizer.json")
    assert result.exit_code == 0, result.output
    first, second = read_jsonl(tmp_path / "out.jsonl")
    assert first["id"] == 1 and first["output_ids"] == library_tokens(lm, [3, 7, 11])
    assert second["output_ids"] == library_tokens(lm, [4, 9])
    assert first["text"] == " ".join(f"w{i}" for i in first["output_ids"])


@pytest.mark.parametrize("suffix", [".npz", ".parquet"])
def test_npz_and_parquet_prompts_give_the_jsonl_outputs(lm, tmp_path, suffix):
    given = prompts(4, seed=2)
    source = tmp_path / f"in{suffix}"
    if suffix == ".npz":
        np.savez(source, **{k: np.asarray(v, np.int64) for k, v in given.items()})
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"id": list(given), "input_ids": list(given.values())}), source)
    result = run(lm, "--input", source, "--output", tmp_path / "out.jsonl", "--max-new-tokens", MAX_NEW)
    assert result.exit_code == 0, result.output
    assert {r["id"]: r["output_ids"] for r in read_jsonl(tmp_path / "out.jsonl")} == {
        k: library_tokens(lm, v) for k, v in given.items()
    }


def test_an_unreadable_prompt_file_is_one_line_naming_it(lm, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": ["a"], "input_ids": [[1, 2]]}), tmp_path / "in.parquet")
    data = (tmp_path / "in.parquet").read_bytes()
    (tmp_path / "in.parquet").write_bytes(data[: len(data) // 2])
    (tmp_path / "in.npz").write_bytes(b"not a zip")
    pq.write_table(pa.table({"id": ["a"], "text": ["x"]}), tmp_path / "cols.parquet")
    for name, fragment in (("in.parquet", "cannot read it"), ("in.npz", "cannot read it"),
                           ("cols.parquet", "needs columns id and input_ids (list of int) or prompt (string)")):
        result = run(lm, "--input", tmp_path / name, "--output", tmp_path / "out.jsonl")
        error = result.stderr.strip()
        assert result.exit_code == 1 and name in error and fragment in error and "\n" not in error, error
        assert not list(tmp_path.glob("*out.jsonl*"))


BAD_PROMPTS = [
    ({"id": "far", "input_ids": [3, VOCAB]}, f"prompt 'far': token id {VOCAB} is past the model's vocabulary"),
    ({"id": "neg", "input_ids": [-1, 2]}, "prompt 'neg': token id -1 is past the model's vocabulary"),
    ({"id": "empty", "input_ids": []}, "prompt 'empty': is empty; give at least one token"),
    ({"id": "long", "input_ids": [1] * 13}, "prompt 'long': 13 tokens + 8 new ones exceed --max-length 20"),
    ({"id": "text", "prompt": "hello"}, "prompt 'text': a text prompt needs --tokenizer"),
    ({"id": "floats", "input_ids": [1.5]}, "prompt 'floats': \"input_ids\" must be a list of integer token ids"),
    ({"input_ids": [1]}, "line 2 is not an object with an \"id\""),
    ({"id": "ok", "input_ids": [1]}, "prompt 'ok': appears twice in this shard"),
]


@pytest.mark.parametrize(("bad", "message"), BAD_PROMPTS, ids=[m.split(":")[0] for _, m in BAD_PROMPTS])
def test_a_bad_prompt_is_one_line_naming_it_or_skipped(lm, tmp_path, bad, message):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "ok", "input_ids": [5, 6]}, bad, {"id": "ok2",
                                                                                          "input_ids": [7]}])
    args = [lm, "--input", source, "--output", tmp_path / "out.jsonl", "--max-new-tokens", MAX_NEW,
            "--max-length", 20]
    result = run(*args)
    error = result.stderr.strip()
    assert result.exit_code == 1 and error.startswith(f"error: in.jsonl: {message}") and "\n" not in error, error
    assert not list(tmp_path.glob("*out.jsonl*")), "no output, no temporary, no manifest"
    result = run(*args, "--on-error", "skip")
    assert result.exit_code == 0, result.output
    assert f"skipped in.jsonl: {message}" in result.stderr and "1 bad prompts skipped" in result.stdout
    assert [r["id"] for r in read_jsonl(tmp_path / "out.jsonl")] == ["ok", "ok2"]


def test_the_files_max_length_bounds_prompts_and_new_tokens(tmp_path):
    path = tmp_path / "lm16.onnx"
    inputs = [arg for spec in user_module("causal_lm").INPUTS for arg in ("--input", spec)]
    result = CliRunner().invoke(main, ["export", "--module", f"{USER_MODELS / 'causal_lm'}.py:build", *inputs,
                                       "--kv-cache", "--max-length", "16", "-o", str(path)])
    assert result.exit_code == 0, result.output
    source = write_jsonl(tmp_path / "in.jsonl",
                         [{"id": "fits", "input_ids": [1] * 8}, {"id": "no", "input_ids": [1] * 9}])
    result = run(path, "--input", source, "--output", tmp_path / "out.jsonl", "--max-new-tokens", MAX_NEW,
                 "--on-error", "skip")
    assert result.exit_code == 0, result.output
    assert "prompt 'no': 9 tokens + 8 new ones exceed the file's max_length 16" in result.stderr
    assert [r["id"] for r in read_jsonl(tmp_path / "out.jsonl")] == ["fits"]


def test_a_rerun_with_other_settings_is_refused_until_overwrite(lm, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "input_ids": [1, 2, 3]}])
    args = [lm, "--input", source, "--output", tmp_path / "out.jsonl"]
    assert run(*args, "--max-new-tokens", 4).exit_code == 0
    again = run(*args, "--max-new-tokens", 4)
    assert again.exit_code == 0 and "nothing to do" in again.stdout
    other = run(*args, "--max-new-tokens", 5)
    assert other.exit_code == 1 and "made with other settings (generation differ)" in other.stderr, other.stderr
    assert run(*args, "--max-new-tokens", 5, "--overwrite").exit_code == 0
    assert len(read_jsonl(tmp_path / "out.jsonl")[0]["output_ids"]) == 5


def test_sampling_with_a_seed_is_reproducible_and_the_seed_matters(lm, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": k, "input_ids": v} for k, v in prompts(6, seed=3).items()])
    outputs = []
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        result = run(lm, "--input", source, "--output", tmp_path / f"{name}.jsonl", "--do-sample", "--seed", seed,
                     "--top-k", 20, "--batch-size", 2)
        assert result.exit_code == 0, result.output
        outputs.append((tmp_path / f"{name}.jsonl").read_bytes())
    assert outputs[0] == outputs[1] and outputs[0] != outputs[2]


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("mha-deploy")
    return [str(script)] if script.exists() else [sys.executable, "-m", "mha_deploy.cli"]


@pytest.mark.slow
def test_sigkill_then_rerun_equals_an_uninterrupted_run(lm, tmp_path):
    """A real process killed with SIGKILL after its first output shard; the rerun finishes it, byte for byte
    (sampling, so that a rerun drawing differently would show)."""
    (tmp_path / "in").mkdir()
    for shard in range(5):
        write_jsonl(tmp_path / "in" / f"shard-{shard}.jsonl",
                    [{"id": k, "input_ids": v} for k, v in prompts(12, seed=10 + shard).items()])
    command = [*_cli(), "generate", str(lm), "--input", str(tmp_path / "in"), "--threads", "1", "--batch-size", "2",
               "--max-new-tokens", "24", "--do-sample", "--seed", "7", "--no-progress"]
    reference = subprocess.run([*command, "--output", str(tmp_path / "reference")], capture_output=True, timeout=300)
    assert reference.returncode == 0, reference.stderr

    out = tmp_path / "out"
    process = subprocess.Popen([*command, "--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not any(p.suffix == ".jsonl" and not p.name.startswith(".") for p in out.glob("*")):
        assert process.poll() is None and time.monotonic() < deadline, "no output shard before the process ended"
        time.sleep(0.005)
    time.sleep(0.05)  # past the manifest update that follows the rename, into the next shard
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    finished = [p.name for p in out.iterdir() if p.suffix == ".jsonl" and not p.name.startswith(".")]
    assert 1 <= len(finished) < 5, f"the kill came after every shard was done: {finished}"

    rerun = subprocess.run([*command, "--output", str(out)], capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert "already done" in rerun.stdout, rerun.stdout

    def files(root: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.suffix == ".jsonl"}

    assert files(out) == files(tmp_path / "reference"), "same shards, same bytes"
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name], "no temporary file left"


@pytest.mark.parametrize("search", [[], ["--num-beams", "3"]], ids=["greedy", "beams"])
def test_an_encoder_decoder_from_its_start_id_equals_the_library_loop(seq2seq, tmp_path, search):
    decoder, encoder, start, vocab = seq2seq  # tests/conftest.py's, shared with the serving and Ray tests
    rng = np.random.default_rng(4)
    given = {f"s{i}": rng.integers(1, vocab, n).tolist() for i, n in enumerate([3, 9, 1, 6])}
    source = write_jsonl(tmp_path / "src.jsonl", [{"id": k, "input_ids": v} for k, v in given.items()])
    result = run(decoder, "--encoder", encoder, "--start-id", start, "--input", source,
                 "--output", tmp_path / "out.jsonl", "--max-new-tokens", MAX_NEW, *search)
    assert result.exit_code == 0, result.output
    stepper = KVCacheStepper(decoder, encoder=encoder, decoder_start_token_id=start)
    options = {"num_beams": int(search[1])} if search else {}
    for record in read_jsonl(tmp_path / "out.jsonl"):
        alone = generate(stepper, [given[record["id"]]], max_new_tokens=MAX_NEW, **options).tokens[0].tolist()
        assert record["output_ids"] == alone, record["id"]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"id": "x", "input_ids": [vocab]}])
    result = run(decoder, "--encoder", encoder, "--start-id", start, "--input", bad,
                 "--output", tmp_path / "bad-out.jsonl")
    assert result.exit_code == 1 and "prompt 'x': token id" in result.stderr and "vocabulary" in result.stderr
    assert run(decoder, "--encoder", encoder, "--input", source,
               "--output", tmp_path / "o.jsonl").exit_code == 2, "an encoder without a start id is a usage error"
