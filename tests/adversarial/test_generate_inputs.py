"""Attacks on ``mha-deploy generate`` and the generation loop: options at the edges of their types (NaN, inf, a
length penalty whose power overflows, a seed past 64 bits, an end id past the vocabulary) and prompt files that
say more than ids (a padding mask, ids that are not ids), and a manifest left behind by deleted outputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result

from mha_deploy.cli import main
from mha_deploy.errors import OptionError
from mha_deploy.runtime.generation import FLOAT_OPTIONS, GenerationConfig, generate
from tests.adversarial.conftest import assert_loud
from tests.runtime.fixed_logits import FixedLogits

pytest.importorskip("torch")

VOCAB = 50  # tests/user_models/causal_lm.py's
# Every step's distribution: token 0 at 0.5, 1 at 0.3, 2 (the end id below) at 0.2.
HALF_THIRD_FIFTH = np.log([0.5, 0.3, 0.2])


@pytest.fixture
def lm(lm_cache) -> Path:
    return lm_cache("causal_lm")[0]  # export --module --kv-cache, shared with the other generation tests


def generate_cli(model: Path, source: Path, output: Path, *options: object) -> Result:
    args = ["generate", model, "--input", source, "--output", output, "--no-progress", *options]
    return CliRunner().invoke(main, [str(a) for a in args])


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- beam search's length penalty ------------------------------------------------------------------------------


@pytest.mark.parametrize("length_penalty", [-50.0, -30.0, -20.0, -1.0, 0.0, 1.0, 50.0])
def test_beam_search_returns_the_best_hypothesis_for_any_finite_length_penalty(length_penalty):
    """The end id never ranks among the best two continuations, so the hypotheses are the beams the length limit
    ends: six tokens of 0, log-probability 6 log 0.5. With -20 that scores -4e15, below the -1e9 that marks an
    empty slot in transformers' scorer, and the prompt used to come back with no token at all."""
    out = generate(FixedLogits(HALF_THIRD_FIFTH), [[1], [2, 0]], num_beams=2, max_new_tokens=6, eos_token_id=2,
                   length_penalty=length_penalty)
    assert [t.tolist() for t in out.tokens] == [[0] * 6, [0] * 6]
    expected = 6 * math.log(0.5) / 6**length_penalty
    np.testing.assert_allclose(out.scores, [expected, expected], rtol=1e-6)


@pytest.mark.parametrize("length_penalty", [math.nan, math.inf, -math.inf, 1e308, -1e308])
def test_a_length_penalty_that_cannot_score_is_refused(length_penalty):
    with pytest.raises(OptionError, match="length_penalty must be"):
        GenerationConfig(num_beams=2, length_penalty=length_penalty)


def test_generate_beams_with_a_negative_length_penalty_and_refuses_one_that_cannot_score(lm, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "input_ids": [1, 2, 3]}, {"id": "b", "input_ids": [4]}])
    result = generate_cli(lm, source, tmp_path / "out.jsonl", "--num-beams", 3, "--max-new-tokens", 5,
                          "--length-penalty", -20)
    assert result.exit_code == 0, result.output
    assert "2 prompts, 10 new tokens" in result.stdout
    assert [len(r["output_ids"]) for r in read_jsonl(tmp_path / "out.jsonl")] == [5, 5]
    for bad, message in (("nan", "length_penalty must be a finite number, got nan"),
                         ("-inf", "length_penalty must be a finite number, got -inf"),
                         ("1e308", "length_penalty must be within [-357.7, 357.7] with max_new_tokens=5"),
                         ("-1e308", "length_penalty must be within [-357.7, 357.7] with max_new_tokens=5")):
        output = tmp_path / f"bad{bad}.jsonl"
        assert_loud(generate_cli(lm, source, output, "--num-beams", 3, "--max-new-tokens", 5,
                                 f"--length-penalty={bad}"), message)
        assert not output.exists()


# --- other real-valued options and the seed -----------------------------------------------------------------------


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", FLOAT_OPTIONS)
def test_every_real_valued_option_must_be_finite_even_unused(name, value):
    with pytest.raises(OptionError, match=f"{name} must be a finite number, got {value!r}"):
        GenerationConfig(**{name: value})
    with pytest.raises(OptionError, match=f"{name} must be a finite number"):
        GenerationConfig(do_sample=True, **{name: value})


@pytest.mark.parametrize(("option", "value"), [("--temperature", "inf"), ("--repetition-penalty", "inf"),
                                               ("--top-p", "nan"), ("--presence-penalty", "nan")])
def test_generate_refuses_a_non_finite_option_in_one_line(lm, tmp_path, option, value):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "input_ids": [1, 2, 3]}])
    name = option.removeprefix("--").replace("-", "_")
    assert_loud(generate_cli(lm, source, tmp_path / "out.jsonl", "--do-sample", option, value),
                f"{name} must be a finite number, got {value}")
    assert not (tmp_path / "out.jsonl").exists()


def test_a_seed_past_64_bits_is_refused_and_the_last_one_wraps_per_batch(lm, tmp_path):
    with pytest.raises(OptionError, match=r"seed must be an integer in \[0, 2\*\*64 - 1\]"):
        GenerationConfig(seed=2**64)
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "input_ids": [1, 2, 3]}, {"id": "b", "input_ids": [4]}])
    result = generate_cli(lm, source, tmp_path / "out.jsonl", "--do-sample", "--seed", 2**64)
    assert result.exit_code == 2 and "0<=x<=18446744073709551615" in result.output, result.output
    # Batch b samples with seed + b: from the last seed, batch 1 wraps to seed 0 instead of being refused.
    result = generate_cli(lm, source, tmp_path / "out.jsonl", "--do-sample", "--seed", 2**64 - 1, "--batch-size", 1)
    assert result.exit_code == 0, result.output


# --- a padding mask in the prompts --------------------------------------------------------------------------------


def _write_prompts_with_a_mask(path: Path) -> None:
    """Prompt "a" as a tokenizer pads it, its attention_mask kept beside the ids: read as they are, its two zeros
    would be taken for real tokens."""
    ids = {"b": [7, 3], "a": [5, 9, 2, 0, 0]}
    mask = [1, 1, 1, 0, 0]
    if path.suffix == ".jsonl":
        write_jsonl(path, [{"id": "b", "input_ids": ids["b"]},
                           {"id": "a", "input_ids": ids["a"], "attention_mask": mask}])
    elif path.suffix == ".npz":
        np.savez(path, b=np.array(ids["b"]), a=np.array(ids["a"]), **{"a.attention_mask": np.array(mask)})
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"id": ["b", "a"], "input_ids": [ids["b"], ids["a"]],
                                 "attention_mask": [[1, 1], mask]}), path)


@pytest.mark.parametrize(("suffix", "where"), [(".jsonl", "line 2: field attention_mask"),
                                               (".npz", "key 'a.attention_mask'"),
                                               (".parquet", "column attention_mask")])
def test_a_padding_mask_in_a_prompt_file_is_refused_in_one_line_naming_it(lm, tmp_path, suffix, where):
    """As infer refuses it (tests/adversarial/test_masks.py), through the same check, before anything is written:
    the clean shard a.jsonl comes first and leaves no output either."""
    from mha_deploy.batch.generation import read_prompts
    from mha_deploy.errors import InputError

    folder = tmp_path / "in"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", [{"id": "clean", "input_ids": [1, 2]}])
    source = folder / f"b{suffix}"
    _write_prompts_with_a_mask(source)
    assert_loud(generate_cli(lm, folder, tmp_path / "out", "--max-new-tokens", 2),
                f"{source}: {where}: attention_mask is this model's padding mask",
                "remove it and keep only each item's real tokens")
    assert not (tmp_path / "out").exists()
    with pytest.raises(InputError, match=f"{where}: attention_mask is this model's padding mask"):
        list(read_prompts(source))


# --- end ids -------------------------------------------------------------------------------------------------------


def test_an_end_id_past_the_vocabulary_is_refused_naming_it(lm, tmp_path):
    """The model never produces id 50 of a 50-id vocabulary: such an end id would end no row, without a word."""
    from mha_deploy.runtime.kv_stepper import KVCacheStepper

    with pytest.raises(OptionError, match=f"eos_token_id {VOCAB} is past the model's vocabulary of {VOCAB} ids"):
        generate(KVCacheStepper(lm), [[1, 2, 3]], eos_token_id=[3, VOCAB])
    with pytest.raises(OptionError, match=f"stop_token_ids {VOCAB + 7} is past the model's vocabulary"):
        generate(KVCacheStepper(lm), [[1, 2, 3]], stop_token_ids=[VOCAB + 7])
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "input_ids": [1, 2, 3]}])
    assert_loud(generate_cli(lm, source, tmp_path / "out.jsonl", "--eos-id", VOCAB),
                f"eos_token_id {VOCAB} is past the model's vocabulary of {VOCAB} ids (0 to {VOCAB - 1})")
    assert not (tmp_path / "out.jsonl").exists()
    assert generate_cli(lm, source, tmp_path / "out.jsonl", "--eos-id", VOCAB - 1).exit_code == 0


# --- prompt ids ----------------------------------------------------------------------------------------------------


def test_an_id_that_is_no_string_or_integer_is_a_bad_prompt_naming_its_line(lm, tmp_path):
    """The output line carries the id back as given: every null would read alike, an object names nothing."""
    bad = [None, {"a": 1}, True, 1.5, [1]]
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "ok", "input_ids": [1, 2]}, {"id": 7, "input_ids": [3]},
                                                 *({"id": i, "input_ids": [4]} for i in bad)])
    assert_loud(generate_cli(lm, source, tmp_path / "out.jsonl", "--max-new-tokens", 2),
                'in.jsonl: line 3: "id" must be a string or an integer, got null')
    assert not (tmp_path / "out.jsonl").exists()
    result = generate_cli(lm, source, tmp_path / "out.jsonl", "--max-new-tokens", 2, "--on-error", "skip")
    assert result.exit_code == 0, result.output
    assert [r["id"] for r in read_jsonl(tmp_path / "out.jsonl")] == ["ok", 7]
    for line, given in enumerate(bad, 3):
        assert f'skipped in.jsonl: line {line}: "id" must be a string or an integer, got {json.dumps(given)}' in (
            result.stderr), result.stderr


def test_a_null_parquet_id_is_a_bad_prompt_naming_its_row(lm, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a", None, "c"], "input_ids": [[1, 2], [3], [4]]}), source)
    assert_loud(generate_cli(lm, source, tmp_path / "out.jsonl", "--max-new-tokens", 2),
                'in.parquet: row 2: "id" must be a string or an integer, got null')
    result = generate_cli(lm, source, tmp_path / "out.jsonl", "--max-new-tokens", 2, "--on-error", "skip")
    assert result.exit_code == 0, result.output
    assert [r["id"] for r in read_jsonl(tmp_path / "out.jsonl")] == ["a", "c"]


# --- a manifest left behind --------------------------------------------------------------------------------------


def test_a_manifest_whose_output_was_deleted_is_redone_not_refused(lm, tmp_path):
    """The manifest guards outputs made another way from being mixed with this run's; with its output deleted it
    guards nothing, so a run with other settings redoes the shard, saying why, as a run with the same ones does."""
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "input_ids": [1, 2, 3]}])
    output = tmp_path / "out.jsonl"
    assert generate_cli(lm, source, output, "--max-new-tokens", 2).exit_code == 0
    output.unlink()
    result = generate_cli(lm, source, output, "--max-new-tokens", 3)
    assert result.exit_code == 0, result.output
    assert f"redid in.jsonl: its output {output} is missing" in result.stderr
    assert [len(r["output_ids"]) for r in read_jsonl(output)] == [3]
    # While an output it records exists, other settings are refused as before.
    assert_loud(generate_cli(lm, source, output, "--max-new-tokens", 4),
                f"{output}: existing outputs were made with other settings (generation differ)")
    assert [len(r["output_ids"]) for r in read_jsonl(output)] == [3]
