"""``--engine ray``: the same job on a local Ray cluster the test starts, the same bytes as the local engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest
import ray
import ray.data
from click.testing import CliRunner

from mha_deploy.batch.job import DatasetJob
from mha_deploy.batch.ray_engine import RayOptions, run_dataset_on_ray
from mha_deploy.cli import main
from mha_deploy.errors import InputError, ProviderUnavailableError
from mha_deploy.metadata import Signature
from tests.batch.test_resume import files, write_dataset
from tests.conftest import TEST_D_MODEL

D = TEST_D_MODEL
SIGNATURE = Signature("self", "padding")


def test_cuda_on_ray_needs_gpus(tmp_path, export_model):
    write_dataset(tmp_path / "in", shards=1, items=2)
    job = DatasetJob(tmp_path / "in", tmp_path / "out", export_model(SIGNATURE)[0])
    with pytest.raises(ProviderUnavailableError, match="needs --num-gpus > 0"):
        run_dataset_on_ray(job, export_model(SIGNATURE)[0], provider="cuda", ray=RayOptions(num_gpus=0))


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_ray_engine_equals_local_engine(tmp_path, export_model, ray_cluster):
    from tests.batch.test_datasets import write_parquet

    model = export_model(SIGNATURE)[0]
    write_dataset(tmp_path / "in", shards=3, items=12, mean_log_length=3.5)
    with np.load(tmp_path / "in" / "shard-2.npz") as arrays:
        write_parquet(tmp_path / "in" / "shard-2.parquet", {k: {"x": arrays[k]} for k in arrays.files})
    (tmp_path / "in" / "shard-2.npz").unlink()
    common = ["infer", model, "--input", tmp_path / "in", "--provider", "cpu", "--max-batch-tokens", "256",
              "--no-progress"]
    invoke = lambda *args: CliRunner().invoke(main, [str(a) for a in [*common, *args]])  # noqa: E731

    local = invoke("--output", tmp_path / "local", "--threads", "1")
    assert local.exit_code == 0, local.output
    result = invoke("--output", tmp_path / "ray", "--engine", "ray", "--concurrency", "2", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["items"] == 36 and summary["shards_written"] == 3 and summary["provider"] == "cpu"
    assert files(tmp_path / "ray") == files(tmp_path / "local"), "same shards, same bytes"

    again = invoke("--output", tmp_path / "ray", "--engine", "ray", "--json")
    assert json.loads(again.stdout)["shards_skipped"] == 3, again.output


@pytest.mark.slow
def test_ray_engine_stops_at_a_bad_item(tmp_path, export_model, ray_cluster):
    model = export_model(SIGNATURE)[0]
    (tmp_path / "in").mkdir()
    np.savez(tmp_path / "in" / "a.npz", good=np.ones((2, D), np.float32), bad=np.ones((0, D), np.float32))
    job = DatasetJob(tmp_path / "in", tmp_path / "out", model)
    with pytest.raises(InputError, match=r"a\.npz: item 'bad': x is empty"):
        run_dataset_on_ray(job, model, provider="cpu", threads=1)
    assert not list((tmp_path / "out").glob("*.npz")), "no output shard"


# --- generate --engine ray ------------------------------------------------------------------------------------

LM_VOCAB = 50  # tests/user_models/causal_lm.py's
GENERATE = ["--max-new-tokens", "8", "--batch-size", "3", "--on-error", "skip", "--no-progress"]


def write_prompt_shards(root, shards: int = 3, prompts: int = 8, vocab: int = LM_VOCAB, bad: dict | None = None):
    """``shards`` JSONL files of prompts of 1 to 12 tokens; ``bad`` (a prompt the run must skip) ends the second."""
    root.mkdir()
    rng = np.random.default_rng(11)
    for shard in range(shards):
        records = [{"id": f"s{shard}-{i}", "input_ids": rng.integers(1, vocab, rng.integers(1, 13)).tolist()}
                   for i in range(prompts)]
        if bad is not None and shard == 1:
            records.append(bad)
        (root / f"shard-{shard}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


def generate_cli(*args):
    return CliRunner().invoke(main, ["generate", *map(str, args)])


def jsonl_files(root):
    return {p.name: p.read_bytes() for p in sorted(root.glob("*.jsonl"))}


def word_tokenizer(path):
    """A tokenizers file whose word ``w<i>`` is id i, for text prompts and outputs."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tokenizer = Tokenizer(WordLevel({f"w{i}": i for i in range(LM_VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(path))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("search", [[], ["--do-sample", "--seed", "7", "--top-k", "20"]], ids=["greedy", "seeded"])
def test_generate_on_ray_equals_the_local_engine(tmp_path, lm_cache, ray_cluster, search):
    """2 actors over 3 shards give the local engine's bytes (a seeded run's batch b samples with seed + b in both;
    a text prompt through the tokenizer each actor loads), and skip the bad prompt as it does, listed in the
    summary and the manifest."""
    lm = lm_cache("causal_lm")[0]
    source = write_prompt_shards(tmp_path / "in", bad={"id": "bad", "input_ids": [LM_VOCAB]})
    with (source / "shard-0.jsonl").open("a") as lines:
        lines.write(json.dumps({"id": "text", "prompt": "w3 w7 w11"}) + "\n")
    common = [*GENERATE, *search, "--tokenizer", word_tokenizer(tmp_path / "tokenizer.json"), "--json"]
    local = generate_cli(lm, "--input", source, "--output", tmp_path / "local", "--threads", 1, *common)
    assert local.exit_code == 0, local.output
    result = generate_cli(lm, "--input", source, "--output", tmp_path / "ray", "--engine", "ray", "--concurrency", 2,
                          *common)
    assert result.exit_code == 0, result.output
    assert jsonl_files(tmp_path / "ray") == jsonl_files(tmp_path / "local"), "same shards, same bytes"
    assert b'"id": "text", "output_ids"' in jsonl_files(tmp_path / "ray")["shard-0.jsonl"]
    summary, expected = json.loads(result.stdout), json.loads(local.stdout)
    assert (summary["items"], summary["tokens"], summary["shards_written"]) == (25, 25 * 8, 3)
    assert summary["errors"] == expected["errors"] and "'bad': token id 50 is past" in str(summary["errors"])
    manifest = json.loads((tmp_path / "ray" / "_mha_deploy_manifest.json").read_text())
    assert [e["id"] for e in manifest["shards"]["shard-1.jsonl"]["skipped_items"]] == ["bad"]


@pytest.mark.slow
def test_generate_on_ray_killed_after_a_shard_resumes_to_the_same_bytes(tmp_path, lm_cache, ray_cluster):
    """A real driver process on this cluster, killed with SIGKILL once its manifest records a shard: its lock goes
    with it and Ray ends its actors, so the rerun gets the CPUs, skips the recorded shards and redoes the others
    to the local engine's bytes (seeded sampling), leaving no temporary file."""
    from tests.batch.test_generation import _cli

    lm = lm_cache("causal_lm")[0]
    source = write_prompt_shards(tmp_path / "in", shards=5, prompts=24)
    args = [lm, "--input", source, "--max-new-tokens", 24, "--batch-size", 2, "--do-sample", "--seed", 5,
            "--no-progress"]
    local = generate_cli(*args, "--output", tmp_path / "local", "--threads", 1)
    assert local.exit_code == 0, local.output

    out, manifest = tmp_path / "ray", tmp_path / "ray" / "_mha_deploy_manifest.json"
    address = ray_cluster.get_runtime_context().gcs_address
    process = subprocess.Popen([*_cli(), "generate", *map(str, args), "--output", str(out), "--engine", "ray",
                                "--ray-address", address, "--concurrency", "2"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (manifest.exists() and json.loads(manifest.read_text() or "{}").get("shards")):
        assert process.poll() is None and time.monotonic() < deadline, "no shard recorded before the process ended"
        time.sleep(0.005)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    recorded = json.loads(manifest.read_text())["shards"]
    assert 1 <= len(recorded) < 5, f"the kill came after every shard was done: {sorted(recorded)}"

    rerun = generate_cli(*args, "--output", out, "--engine", "ray", "--concurrency", 2, "--json")
    assert rerun.exit_code == 0, rerun.output
    assert json.loads(rerun.stdout)["shards_skipped"] >= len(recorded)
    assert jsonl_files(out) == jsonl_files(tmp_path / "local"), "same shards, same bytes"
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name], "no temporary file left"


@pytest.mark.slow
def test_generate_on_ray_runs_an_encoder_decoder_and_stops_at_a_bad_source(tmp_path, seq2seq, ray_cluster):
    decoder, encoder, start, vocab = seq2seq
    pair = ["--encoder", encoder, "--start-id", start, "--max-new-tokens", 8, "--no-progress"]
    source = write_prompt_shards(tmp_path / "in", shards=2, prompts=5, vocab=vocab)
    local = generate_cli(decoder, "--input", source, "--output", tmp_path / "local", "--threads", 1, *pair)
    assert local.exit_code == 0, local.output
    result = generate_cli(decoder, "--input", source, "--output", tmp_path / "ray", "--engine", "ray",
                          "--concurrency", 2, *pair)
    assert result.exit_code == 0, result.output
    assert jsonl_files(tmp_path / "ray") == jsonl_files(tmp_path / "local"), "same shards, same bytes"

    bad = write_prompt_shards(tmp_path / "bad", shards=1, prompts=2, vocab=vocab, bad=None)
    with (bad / "shard-0.jsonl").open("a") as lines:
        lines.write(json.dumps({"id": "x", "input_ids": [vocab]}) + "\n")
    result = generate_cli(decoder, "--input", bad, "--output", tmp_path / "bad-out", "--engine", "ray", *pair)
    assert result.exit_code == 1 and "shard-0.jsonl: prompt 'x': token id" in result.stderr, result.output
    assert not list((tmp_path / "bad-out").glob("*.jsonl")), "no output shard"


def test_a_refused_rerun_on_ray_keeps_the_earlier_runs_manifest(tmp_path, lm_cache):
    """Refused at its plan (other settings), before any actor: the finished shards stay recorded, so the right
    rerun still skips them."""
    lm = lm_cache("causal_lm")[0]
    source = write_prompt_shards(tmp_path / "in", shards=2, prompts=2)
    args = [lm, "--input", source, "--output", tmp_path / "out", "--no-progress"]
    assert generate_cli(*args, "--max-new-tokens", 4).exit_code == 0
    refused = generate_cli(*args, "--max-new-tokens", 5, "--engine", "ray")
    assert refused.exit_code == 1 and "made with other settings (generation differ)" in refused.stderr, refused.output
    manifest = json.loads((tmp_path / "out" / "_mha_deploy_manifest.json").read_text())
    assert sorted(manifest["shards"]) == ["shard-0.jsonl", "shard-1.jsonl"]
    again = generate_cli(*args, "--max-new-tokens", 4, "--engine", "ray")
    assert again.exit_code == 0 and "nothing to do" in again.stdout, again.output
