"""onnxruntime-genai, an oracle written elsewhere, generating from our KV-cache export as it is (``export
--kv-cache --genai``): its greedy tokens equal the torch-free loop's (``runtime.generation.generate``) on the same
file, in either cache layout and at int4, for one prompt and for a batch of two prompts of different lengths
(right-padded with the recorded pad id, as onnxruntime-genai pads), rows ending at the recorded eos id at different
steps.
onnxruntime-genai runs in ``.venv-genai`` (scripts/setup.sh), in a subprocess: it brings its own onnxruntime."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("torch")

from click.testing import CliRunner

from mha_deploy.bench.genai import genai_python, run_genai_greedy
from mha_deploy.cli import main
from mha_deploy.metadata import GenerationIds
from mha_deploy.runtime.generation import generate
from mha_deploy.runtime.kv_stepper import KVCacheStepper
from tests.conftest import USER_MODELS, randomise_parameters, user_module

pytestmark = pytest.mark.skipif(
    genai_python() is None, reason="no .venv-genai: scripts/setup.sh installs onnxruntime-genai there"
)

MAX_LENGTH, PAD, NEW_TOKENS = 64, 0, 20
# eos ids that each model's greedy tokens for the batch below reach at different steps in the two rows (asserted
# in the test, so that a change of weights that makes them never fire fails instead of testing less).
EOS = {"causal_lm": 43, "hf_gpt2": 83}
# The files onnxruntime-genai runs: each model's default export (the ragged layout, a shared past/present buffer in
# the config), the tutorial LM's holes layout (a Concat per step, no shared buffer) and its weight-only int4 file
# (MatMulNBits, taken as it is).
FILES = {"causal_lm": ("causal_lm", ()), "causal_lm-holes": ("causal_lm", ("--cache-layout", "holes")),
         "causal_lm-int4": ("causal_lm", ("--quantize", "int4")), "hf_gpt2": ("hf_gpt2", ())}
PROMPTS = {"one": [[5, 7, 9]], "two-lengths": [[5, 7, 9, 11, 3, 8], [4, 2]]}


@pytest.fixture(scope="session")
def genai_model(tmp_path_factory):
    """``genai_model(name) -> path``: the tutorial LM exported by the CLI with ``--kv-cache --genai`` and the ids
    recorded; Hugging Face GPT-2 from a config (weights drawn afresh: its initial ones repeat one token) by the
    library's equivalents, ``export_model(generation=...)`` and ``write_genai_config``. Each in a directory of
    its own, as onnxruntime-genai reads one config per directory; exported once per session."""
    from mha_deploy.exporters import export_model
    from mha_deploy.runtime.genai_config import write_genai_config

    made = {}

    def export(file: str):
        name, flags = FILES[file]
        if file not in made:
            path = tmp_path_factory.mktemp(f"genai-{file}") / "model.onnx"
            module = user_module(name)
            if name == "causal_lm":
                inputs = [arg for spec in module.INPUTS for arg in ("--input", spec)]
                result = CliRunner().invoke(main, [
                    "export", "--module", f"{USER_MODELS / name}.py:build", *inputs, "--kv-cache",
                    "--eos-id", str(EOS[name]), "--pad-id", str(PAD), "--max-length", str(MAX_LENGTH), "--genai",
                    *flags, "-o", str(path)])
                assert result.exit_code == 0, result.output
                assert f"wrote {path.parent / 'genai_config.json'}" in result.output
            else:
                export_model(randomise_parameters(module.build(), 3), path, module.INPUTS, kv_cache=True,
                             max_length=MAX_LENGTH, generation=GenerationIds([EOS[name]], PAD))
                write_genai_config(path)
            made[file] = path
        return made[file]

    return export


@pytest.mark.parametrize("file, shared", [("causal_lm", True), ("causal_lm-holes", False)])
def test_the_config_names_the_files_interface_and_its_recorded_ids(genai_model, file, shared):
    path = genai_model(file)
    config = json.loads((path.parent / "genai_config.json").read_text())
    model, decoder = config["model"], config["model"]["decoder"]
    assert (model["type"], model["context_length"], model["vocab_size"]) == ("decoder", MAX_LENGTH, 50)
    assert (model["eos_token_id"], model["pad_token_id"]) == (EOS["causal_lm"], PAD)
    assert decoder["filename"] == "model.onnx"
    assert (decoder["num_hidden_layers"], decoder["num_attention_heads"], decoder["head_size"]) == (2, 4, 8)
    assert decoder["inputs"] == {
        "input_ids": "input_ids", "attention_mask": "attention_mask",
        "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value",
    }
    assert decoder["outputs"]["present_key_names"] == "present.%d.key"
    assert config["search"]["past_present_share_buffer"] is shared  # ragged: GroupQueryAttention writes in place
    assert config["search"]["max_length"] == MAX_LENGTH and config["search"]["do_sample"] is False


def test_the_models_bos_id_comes_from_its_config_and_a_recorded_start_id_wins(genai_model):
    """GPT-2's config names bos 0 (the export was given eos and pad only): recorded as the model's bos, apart from a
    start id (so prompts stay as given), and written as onnxruntime-genai's bos_token_id; a start id recorded at
    export (``--start-id``) is the one asked for, and wins."""
    from mha_deploy.model_report import read_metadata
    from mha_deploy.runtime.genai_config import genai_config

    path = genai_model("hf_gpt2")
    model = json.loads((path.parent / "genai_config.json").read_text())["model"]
    assert (model["eos_token_id"], model["pad_token_id"], model["bos_token_id"]) == (EOS["hf_gpt2"], PAD, 0)
    metadata = read_metadata(path)
    assert (metadata.generation.bos_token_id, metadata.generation.decoder_start_token_id) == (0, None)
    started = replace(metadata, generation=replace(metadata.generation, decoder_start_token_id=5))
    assert genai_config(started, path.name)["model"]["bos_token_id"] == 5


@pytest.mark.parametrize("prompts", PROMPTS.values(), ids=PROMPTS.keys())
@pytest.mark.parametrize("file", FILES)
def test_onnxruntime_genai_generates_our_greedy_tokens_from_the_file_unchanged(genai_model, file, prompts):
    path, name = genai_model(file), FILES[file][0]
    width = max(map(len, prompts))
    ids = np.array([prompt + [PAD] * (width - len(prompt)) for prompt in prompts], np.int64)
    mask = (np.arange(width) < np.array([[len(p)] for p in prompts])).astype(np.int64)
    # No eos given: the loop ends rows at the one the file recorded, as onnxruntime-genai does from its config.
    ours = generate(KVCacheStepper(path), ids, mask, max_new_tokens=NEW_TOKENS).tokens
    theirs = run_genai_greedy(path.parent, ids.tolist(), width + NEW_TOKENS).new_tokens(width)
    for row, (mine, genai) in enumerate(zip(ours, theirs, strict=True)):
        mine = mine.tolist()
        ended = mine[-1] == EOS[name]
        before_eos = mine[:-1] if ended else mine
        assert genai[: len(before_eos)] == before_eos, f"row {row}: onnxruntime-genai {genai}, ours {mine}"
        # A row ended by eos: onnxruntime-genai keeps its eos unless that step ended the whole batch (0.18 leaves
        # the last step's tokens out of the sequences), then pads it until the batch ends.
        rest = genai[len(before_eos):]
        assert (rest[:1] in ([], [EOS[name]]) and set(rest[1:]) <= {PAD}) if ended else not rest, (
            f"row {row}: onnxruntime-genai {genai}, ours {mine}")
    if len(prompts) > 1:
        ends = [len(mine) for mine in ours]
        assert all(mine[-1] == EOS[name] for mine in ours) and len(set(ends)) > 1, (
            f"the eos id {EOS[name]} no longer ends the rows at different steps ({ends}): choose another")
