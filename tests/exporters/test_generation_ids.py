"""Ids recorded at export (``export --kv-cache --eos-id --pad-id --start-id``): kept in the file, shown by
``inspect``, the defaults of ``mha-deploy generate`` and of the generation loop (what is given wins), refused
past the vocabulary; ``genai-config`` and ``export --genai`` refusing what onnxruntime-genai cannot run, leaving
nothing; ``generate --provider cuda`` failing loudly where CUDA cannot run."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")

from click.testing import CliRunner

from mha_deploy.cli import main
from mha_deploy.metadata import GenerationIds
from mha_deploy.model_report import read_metadata
from mha_deploy.runtime.generation import generate
from mha_deploy.runtime.kv_stepper import KVCacheStepper
from tests.conftest import USER_MODELS, user_module

LM = f"{USER_MODELS / 'causal_lm'}.py:build"  # vocabulary 50
LM_INPUTS = [arg for spec in user_module("causal_lm").INPUTS for arg in ("--input", spec)]
# Two eos ids the tutorial LM's greedy tokens reach from PROMPTS (asserted below, so that they keep meaning it).
EOS, PAD, START = (43, 21), 0, 1
PROMPTS = [[5, 7, 9, 11, 3, 8], [4, 2, 6, 1, 9, 9]]


@pytest.fixture(scope="session")
def lm_with_ids(tmp_path_factory):
    """The tutorial LM exported once with every id recorded; (path, the CLI's output)."""
    path = tmp_path_factory.mktemp("ids") / "lm.onnx"
    ids = ["--eos-id", str(EOS[0]), "--eos-id", str(EOS[1]), "--pad-id", str(PAD), "--start-id", str(START)]
    result = CliRunner().invoke(main, ["export", "--module", LM, *LM_INPUTS, "--kv-cache", *ids, "--max-length", "32",
                                       "-o", str(path)])
    assert result.exit_code == 0, result.output
    return path, result.output


def test_the_ids_are_recorded_and_shown_by_inspect(lm_with_ids):
    path, output = lm_with_ids
    assert read_metadata(path).generation == GenerationIds(list(EOS), PAD, START)
    # A causal LM starts from its prompt: the start id is kept, and the export says what becomes of it.
    assert f"decoder start id {START} recorded, but this causal LM starts from its prompt" in output
    result = CliRunner().invoke(main, ["inspect", str(path)])
    assert result.exit_code == 0, result.output
    assert f"generate eos {EOS[0]}, {EOS[1]}, pad {PAD}, decoder start {START}" in result.output
    assert json.loads(CliRunner().invoke(main, ["inspect", str(path), "--json"]).output)["metadata"]["generation"] == {
        "eos_token_ids": list(EOS), "pad_token_id": PAD, "decoder_start_token_id": START}


def test_the_loop_ends_rows_at_the_recorded_eos_ids_unless_told_otherwise(lm_with_ids):
    path, _ = lm_with_ids
    stepper = KVCacheStepper(path)
    recorded = generate(stepper, PROMPTS, max_new_tokens=12)
    none = generate(stepper, PROMPTS, max_new_tokens=12, eos_token_id=[])
    for row, (ended, full) in enumerate(zip(recorded.tokens, none.tokens, strict=True)):
        # each row stops at its first recorded eos id, the run without eos ids goes on past it
        first = next(i for i, token in enumerate(full.tolist()) if token in EOS)  # StopIteration: choose others
        assert ended.tolist() == full[: first + 1].tolist(), f"row {row}"
    assert {int(t[-1]) for t in recorded.tokens} == set(EOS)  # each id ends a row
    assert recorded.pad_token_id == PAD
    given = generate(stepper, PROMPTS, max_new_tokens=12, eos_token_id=EOS[1])
    assert [t.tolist() for t in given.tokens] != [t.tolist() for t in recorded.tokens]


def test_generate_takes_the_recorded_ids_and_its_flags_win(lm_with_ids, tmp_path):
    path, _ = lm_with_ids
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "input_ids": p}) + "\n" for i, p in enumerate(PROMPTS)))
    expected = generate(KVCacheStepper(path), PROMPTS, max_new_tokens=12).tokens

    def run(*flags):
        out = tmp_path / f"out{len(flags)}.jsonl"
        result = CliRunner().invoke(main, ["generate", str(path), "--input", str(prompts), "--output", str(out),
                                           "--max-new-tokens", "12", "--no-progress", *flags])
        assert result.exit_code == 0, result.output
        return [json.loads(line)["output_ids"] for line in out.read_text().splitlines()], result.output

    outputs, said = run()
    assert outputs == [t.tolist() for t in expected]
    assert f"eos ids {EOS[0]}, {EOS[1]} (recorded in lm.onnx)" in said
    outputs, _ = run("--eos-id", "49")
    assert outputs != [t.tolist() for t in expected] and all(49 not in row[:-1] for row in outputs)


@pytest.mark.parametrize(("flag", "value"), [("--eos-id", 50), ("--pad-id", 77)])
def test_an_id_past_the_vocabulary_is_refused_and_nothing_written(tmp_path, flag, value):
    path = tmp_path / "lm.onnx"
    result = CliRunner().invoke(main, ["export", "--module", LM, *LM_INPUTS, "--kv-cache", flag, str(value),
                                       "-o", str(path)])
    assert result.exit_code == 1
    name = flag.removeprefix("--").replace("-", " ")
    assert f"{name} is {value}, past the model's vocabulary of 50 ids (0 to 49)" in result.output
    assert list(tmp_path.iterdir()) == []


def test_ids_and_genai_need_a_kv_cache_export(tmp_path):
    for flags in (["--eos-id", "2"], ["--genai"]):
        args = ["export", "--module", LM, *LM_INPUTS, *flags, "-o", str(tmp_path / "a.onnx")]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and "give --kv-cache" in result.output


def test_export_genai_without_a_max_length_leaves_nothing(tmp_path):
    path = tmp_path / "lm.onnx"
    result = CliRunner().invoke(main, ["export", "--module", LM, *LM_INPUTS, "--kv-cache", "--genai", "-o", str(path)])
    assert result.exit_code == 1
    assert "onnxruntime-genai needs the longest sequence the model takes (context_length)" in result.output
    assert list(tmp_path.iterdir()) == []


def test_genai_config_refuses_a_file_genai_cannot_run_and_writes_nothing(lm_with_ids, tmp_path):
    plain = tmp_path / "mha.onnx"
    assert CliRunner().invoke(main, ["export", "-o", str(plain), "--d-model", "16", "--heads", "2"]).exit_code == 0
    result = CliRunner().invoke(main, ["genai-config", str(plain)])
    assert result.exit_code == 1 and "onnxruntime-genai runs a causal LM's KV-cache file" in result.output
    assert not (tmp_path / "genai_config.json").exists()
    # A recorded max length is the default context_length; --max-length overrides it.
    path, _ = lm_with_ids
    result = CliRunner().invoke(main, ["genai-config", str(path), "--max-length", "24"])
    assert result.exit_code == 0, result.output
    config = json.loads((path.parent / "genai_config.json").read_text())
    assert config["model"]["context_length"] == 24 and config["model"]["bos_token_id"] == START
    assert config["model"]["eos_token_id"] == list(EOS)


def test_generate_on_cuda_fails_loudly_where_cuda_cannot_run(lm_with_ids, tmp_path):
    from mha_deploy.runtime.providers import cuda_unavailable_reason

    if cuda_unavailable_reason() is None:
        pytest.skip("CUDA can run here: the refusal is for machines without it")
    path, _ = lm_with_ids
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": 0, "input_ids": [1, 2]}\n')
    result = CliRunner().invoke(main, ["generate", str(path), "--input", str(prompts), "--output",
                                       str(tmp_path / "o.jsonl"), "--provider", "cuda", "--no-progress"])
    assert result.exit_code == 1 and "provider 'cuda' requested but" in result.output
    assert not (tmp_path / "o.jsonl").exists()


def test_generate_runs_on_the_cpu_provider_when_asked(lm_with_ids):
    path, _ = lm_with_ids
    stepper = KVCacheStepper(path, provider="cpu")
    assert stepper.graph.session.provider == "cpu"
    assert np.array_equal(generate(stepper, [[5, 7]], max_new_tokens=3).padded(),
                          generate(KVCacheStepper(path), [[5, 7]], max_new_tokens=3).padded())
