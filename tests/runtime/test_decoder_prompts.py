"""An encoder-decoder's first tokens, without a model: the forced first token (transformers' ForcedBOS rule: a row
whose history is its decoder start id alone), per-row decoder prompts (the start id put in front where missing, each
checked), the JSONL ``"decoder_prompt"`` field and the checks ``generate`` runs on each item before any batch (a
decoder prompt's ids and length, features of the encoder's sizes), and the forced id recorded in a file's
metadata only when set."""

from __future__ import annotations

import numpy as np
import pytest

from mha_deploy.batch.generation import Prompt, PromptLimits, _record_prompt
from mha_deploy.errors import InputError, OptionError
from mha_deploy.metadata import EncoderDecoderRecord, GenerationIds
from mha_deploy.runtime.generation import GenerationConfig, decoder_prompt_rows, with_recorded_ids
from mha_deploy.runtime.logits import (
    ForcedBOSTokenLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TokenHistory,
)
from mha_deploy.signature import AUDIO, TensorSpec

START, VOCAB = 2, 10


class _Stepper:
    """What decoder_prompt_rows and with_recorded_ids read of a stepper."""

    def __init__(self, start=START, generation=None):
        self.decoder_start_token_id = start
        self.generation_ids = generation


def test_the_forced_first_token_is_the_only_one_after_the_start_id_alone():
    scores = np.arange(2 * VOCAB, dtype=np.float32).reshape(2, VOCAB)
    forced = ForcedBOSTokenLogitsProcessor(7)(TokenHistory(np.full((2, 1), START), 0), scores)
    assert forced[:, 7].tolist() == [0.0, 0.0] and np.isneginf(np.delete(forced, 7, axis=1)).all()
    # A row begun from a longer decoder prompt (or past its first token) is left alone, as transformers leaves it.
    later = TokenHistory(np.array([[START, 5], [START, 6]]), 1)
    assert ForcedBOSTokenLogitsProcessor(7)(later, scores) is scores


def test_suppressed_ids_are_never_generated_and_begin_ones_never_first():
    scores = np.zeros((1, VOCAB), np.float32)
    start = TokenHistory(np.array([[START]]), 0)
    assert np.isneginf(SuppressTokensLogitsProcessor([3, 4, 99])(start, scores)[0, [3, 4]]).all()  # 99: past, ignored
    begin = SuppressTokensAtBeginLogitsProcessor([5])
    assert np.isneginf(begin(start, scores)[0, 5]) and begin(TokenHistory(np.array([[START, 7]]), 1), scores) is scores
    # transformers' begin index moves one on where the first token after the start id alone is forced
    forced = SuppressTokensAtBeginLogitsProcessor([5], forced_bos=True)
    assert forced(start, scores) is scores
    assert np.isneginf(forced(TokenHistory(np.array([[START, 7]]), 1), scores)[0, 5])
    prompted = TokenHistory(np.array([[START, 8, 9]]), 0)  # a decoder prompt: its first new token, forced or not
    assert np.isneginf(forced(prompted, scores)[0, 5])


def test_the_recorded_forced_id_is_the_default_and_a_given_one_wins():
    stepper = _Stepper(generation=GenerationIds([1], 0, START, forced_bos_token_id=7))
    assert with_recorded_ids(GenerationConfig(), stepper).forced_bos_token_id == 7
    assert with_recorded_ids(GenerationConfig(forced_bos_token_id=4), stepper).forced_bos_token_id == 4
    with pytest.raises(OptionError, match="forced_bos_token_id 12 is past the model's vocabulary of 10"):
        GenerationConfig(forced_bos_token_id=12).check_vocabulary(VOCAB)


def test_decoder_prompts_get_the_start_id_in_front_where_missing():
    rows = decoder_prompt_rows(_Stepper(), [None, [5, 6], [START, 5], []], 4)
    assert [row.tolist() for row in rows] == [[START], [START, 5, 6], [START, 5], [START]]


@pytest.mark.parametrize(("stepper", "prompts", "message"), [
    (_Stepper(start=None), [[5]], "decoder prompts are an encoder-decoder's"),
    (_Stepper(), [[5], [6]], "2 decoder prompts for 1 prompts"),
    (_Stepper(), [[5, -1]], "decoder prompt 0 must hold non-negative integer token ids"),
    (_Stepper(), [[0.5]], "decoder prompt 0 must hold non-negative integer token ids"),
])
def test_a_bad_decoder_prompt_is_refused_naming_it(stepper, prompts, message):
    with pytest.raises(InputError, match=message):
        decoder_prompt_rows(stepper, prompts, 1)


def test_a_jsonl_item_carries_its_decoder_prompt():
    prompt = _record_prompt({"id": "x", "input_ids": [4, 5], "decoder_prompt": [START, 7]}, None)
    assert prompt.decoder_prompt.tolist() == [START, 7] and prompt.problem is None
    bad = _record_prompt({"id": "y", "input_ids": [4], "decoder_prompt": "fr"}, None)
    assert bad.problem == "prompt 'y': \"decoder_prompt\" must be a list of integer token ids"


ENCODER_DECODER = PromptLimits(VOCAB, target_max_length=6, target_vocab=VOCAB, encoder_decoder=True,
                               with_new_tokens=False)
FEATURES = PromptLimits(with_new_tokens=False, target_vocab=VOCAB, encoder_decoder=True,
                        features=TensorSpec("input_features", AUDIO, "float32", ("batch", 4, 6)))


@pytest.mark.parametrize(("limits", "prompt", "message"), [
    (PromptLimits(VOCAB), Prompt("a", np.array([3]), decoder_prompt=np.array([START])),
     "prompt 'a': \"decoder_prompt\" is an encoder-decoder's; this model is decoder-only"),
    (ENCODER_DECODER, Prompt("b", np.array([3]), decoder_prompt=np.array([START, 11])),
     "prompt 'b': decoder_prompt token id 11 is past the decoder's vocabulary (0 to 9)"),
    # the start id, 3 more prompt ids and 3 new tokens but the last: 6 fed to a decoder that takes 6
    (ENCODER_DECODER, Prompt("c", np.array([3]), decoder_prompt=np.array([START, 4, 5, 6, 7])),
     "prompt 'c': the decoder takes at most 6 target tokens"),
    (FEATURES, Prompt("d", np.zeros((4, 5), np.float32)),
     "prompt 'd': input_features has frames 5 (expected 6): this model takes audio features of [mel, frames]"),
    (FEATURES, Prompt("e", np.array([3, 4])), "prompt 'e': token ids, but this model's encoder takes input_features"),
    (ENCODER_DECODER, Prompt("f", np.zeros((4, 6), np.float32)),
     "prompt 'f': float features (4, 6), but this model's encoder takes token ids"),
    (FEATURES, Prompt("g", np.full((4, 6), np.nan, np.float32)), "prompt 'g': input_features contains NaN"),
])
def test_each_item_is_checked_before_any_batch_runs(limits, prompt, message):
    assert message in limits.problem(prompt, 3)


def test_items_within_the_limits_pass():
    assert ENCODER_DECODER.problem(Prompt("a", np.array([3]), decoder_prompt=np.array([START, 4, 5])), 3) is None
    assert FEATURES.problem(Prompt("b", np.zeros((4, 6), np.float32)), 3) is None


def test_the_forced_id_is_recorded_only_when_set():
    """A pair's record without a forced id stays what earlier mha-deploy reads; with one, it comes back."""
    plain = EncoderDecoderRecord("decoder", "m.encoder.onnx", GenerationIds([1], 0, START))
    assert set(plain.to_dict()["generation"]) == {"eos_token_ids", "pad_token_id", "decoder_start_token_id"}
    forced = EncoderDecoderRecord("decoder", "m.encoder.onnx", GenerationIds([1], 0, START, forced_bos_token_id=7))
    import json

    back = EncoderDecoderRecord.from_json(json.dumps(forced.to_dict()))
    assert back.generation.forced_bos_token_id == 7 and "forced first token 7" in back.generation.describe()
