"""OpenAI's presence / frequency penalties and logit_bias (runtime.logits, GenerationConfig): each processor against
the formula computed by hand in numpy, greedy generation under them held to a plain reference loop over the same
KV-cache export's logits, and bad values refused, naming what was wrong."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from mha_deploy.errors import InputError, OptionError
from mha_deploy.runtime.generation import GenerationConfig, generate, stream
from mha_deploy.runtime.kv_stepper import KVCacheStepper
from mha_deploy.runtime.logits import (
    LogitBiasLogitsProcessor,
    PresenceFrequencyPenaltyLogitsProcessor,
    TokenHistory,
)
from tests.runtime.fixed_logits import FixedLogits

VOCAB = 50  # TinyLM's (tests/user_models/causal_lm.py)
# Two rows: a left-padded prompt (-1), then 5 generated tokens each; the prompt holds tokens the completion repeats
# (3, 7), which must not count.
HISTORY = TokenHistory(np.array([[-1, 3, 7, 3, 3, 9, 7, 3],
                                 [7, 7, 7, 1, 2, 1, 1, 4]]), generated=5)


@pytest.mark.parametrize(("presence", "frequency"), [(0.5, 0.0), (0.0, 0.7), (1.5, -0.4), (-2.0, 2.0)])
def test_presence_frequency_penalty_is_openais_formula_over_the_completion(presence, frequency):
    scores = np.random.default_rng(0).normal(0, 2, (2, 12)).astype(np.float32)
    got = PresenceFrequencyPenaltyLogitsProcessor(presence, frequency)(HISTORY, scores)
    # By hand: counts over each row's last 5 tokens only, the prompt not counted.
    expected = scores.astype(np.float64)
    for row, completion in enumerate([[3, 3, 9, 7, 3], [1, 2, 1, 1, 4]]):
        for token, count in Counter(completion).items():
            expected[row, token] -= frequency * count + presence
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    assert got.dtype == np.float32 and not np.shares_memory(got, scores)


def test_penalties_before_any_generated_token_change_nothing():
    scores = np.ones((2, 12), np.float32)
    history = TokenHistory(HISTORY.tokens[:, :3], generated=0)  # the prompt alone: it does not count
    np.testing.assert_array_equal(PresenceFrequencyPenaltyLogitsProcessor(1.0, 1.0)(history, scores), scores)


@pytest.mark.parametrize("bias", [{0: 5.0}, {3: -100, 11: 100}, {4: 0.25, 7: -1.5, 9: 2}])
def test_logit_bias_adds_each_tokens_bias_to_every_row(bias):
    scores = np.random.default_rng(1).normal(0, 2, (3, 12)).astype(np.float32)
    scores[1, 5] = -np.inf  # a filtered token stays filtered
    got = LogitBiasLogitsProcessor(bias)(HISTORY, scores)
    expected = scores.copy()
    for token, value in bias.items():
        expected[:, token] += value
    np.testing.assert_array_equal(got, expected)
    assert not np.shares_memory(got, scores)


def test_frequency_penalty_alternates_greedy_as_the_formula_predicts():
    # Token 0 leads token 1 by 0.5; every time 0 is chosen it loses 1.0 (frequency) and the first time 0.25 more
    # (presence): 0 (3.0), then 1 (2.5 > 1.75), then 0 (1.75 > 1.25), then 1 (1.25 > 0.75), then 0 (0.75 > 0.25)...
    stepper = FixedLogits([3.0, 2.5, -5.0, -5.0])
    out = generate(stepper, [[2]], max_new_tokens=6, frequency_penalty=1.0, presence_penalty=0.25)
    assert out.tokens[0].tolist() == [0, 1, 0, 1, 0, 1]
    assert generate(stepper, [[2]], max_new_tokens=6).tokens[0].tolist() == [0] * 6
    # negative penalties reward repetition: token 0 only gains
    assert generate(stepper, [[2]], max_new_tokens=6, frequency_penalty=-1.0).tokens[0].tolist() == [0] * 6


@pytest.mark.parametrize("search", ["greedy", "sampled"])
def test_logit_bias_of_100_forces_its_token_every_step(search):
    stepper = FixedLogits(np.random.default_rng(2).normal(0, 3, 20))
    options = {"do_sample": True, "seed": 4, "temperature": 1.5} if search == "sampled" else {}
    out = generate(stepper, [[1], [2, 3]], max_new_tokens=8, logit_bias={13: 100}, **options)
    assert [t.tolist() for t in out.tokens] == [[13] * 8] * 2


# --- greedy over an mha-deploy KV-cache export (TinyLM), held to a reference loop that applies the formula itself --


@pytest.fixture(scope="module")
def tiny(lm_cache):
    pytest.importorskip("torch")
    return lm_cache("causal_lm")[0]


def reference_greedy(path, prompt: list[int], steps: int, presence=0.0, frequency=0.0, bias=None) -> list[int]:
    """Greedy by hand over the stepper's logits: bias added, then each generated token's penalty subtracted."""
    stepper = KVCacheStepper(path)
    logits = stepper.prefill(np.array([prompt], np.int64), np.ones((1, len(prompt)), np.int64))[0]
    tokens: list[int] = []
    for _ in range(steps):
        scores = logits.astype(np.float64)
        for token, value in (bias or {}).items():
            scores[token] += value
        for token, count in Counter(tokens).items():
            scores[token] -= frequency * count + presence
        tokens.append(int(np.argmax(scores)))
        logits = stepper.step(np.array([tokens[-1]], np.int64))[0]
    return tokens


PROMPTS = [[5, 9, 2], [11, 3, 3, 8, 1, 40, 7]]


@pytest.mark.parametrize(("presence", "frequency"), [(0.0, 2.0), (1.5, 0.0), (0.8, 0.6), (-1.0, -0.5)],
                         ids=["frequency", "presence", "both", "negative"])
def test_greedy_with_penalties_equals_the_reference_loop(tiny, presence, frequency):
    steps = 12
    out = generate(KVCacheStepper(tiny), PROMPTS, max_new_tokens=steps, presence_penalty=presence,
                   frequency_penalty=frequency)
    for prompt, tokens in zip(PROMPTS, out.tokens, strict=True):
        assert tokens.tolist() == reference_greedy(tiny, prompt, steps, presence, frequency)


def test_a_frequency_penalty_changes_greedy_where_the_formula_says(tiny):
    steps = 30
    plain = generate(KVCacheStepper(tiny), PROMPTS, max_new_tokens=steps)
    penalised = generate(KVCacheStepper(tiny), PROMPTS, max_new_tokens=steps, frequency_penalty=2.0)
    rewarded = generate(KVCacheStepper(tiny), PROMPTS, max_new_tokens=steps, frequency_penalty=-2.0)
    for before, after, again in zip(plain.tokens, penalised.tokens, rewarded.tokens, strict=True):
        before, after = before.tolist(), after.tolist()
        # Until greedy first repeats a token, its choice was never generated, so only its rivals can lose: the same
        # tokens. TinyLM's greedy then loops on one token; a penalty of 2 per repeat moves it off it.
        first_repeat = next(i for i, t in enumerate(before) if t in before[:i])
        assert after[:first_repeat] == before[:first_repeat]
        assert after[first_repeat] != before[first_repeat] and len(set(after)) == steps
        # Negative: the first token gains 2 per time it came, and greedy keeps it.
        assert again.tolist() == [before[0]] * steps


def test_logit_bias_forces_and_bans_tokens_over_the_export(tiny):
    forced = generate(KVCacheStepper(tiny), PROMPTS, max_new_tokens=6, logit_bias={17: 100})
    assert [t.tolist() for t in forced.tokens] == [[17] * 6] * 2
    plain = generate(KVCacheStepper(tiny), PROMPTS[:1], max_new_tokens=6).tokens[0].tolist()
    banned = generate(KVCacheStepper(tiny), PROMPTS[:1], max_new_tokens=6, logit_bias={plain[0]: -100}).tokens[0]
    assert plain[0] not in banned.tolist()
    assert banned.tolist() == reference_greedy(tiny, PROMPTS[0], 6, bias={plain[0]: -100})


def test_streamed_tokens_take_the_same_rules():
    stepper = FixedLogits([3.0, 2.5, -5.0, -5.0])
    steps = list(stream(stepper, [[2]], max_new_tokens=4, frequency_penalty=1.0, presence_penalty=0.25))
    assert [int(s.tokens[0]) for s in steps] == [0, 1, 0, 1]


# --- bad values ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "match"), [
    ({"presence_penalty": 2.5}, "presence_penalty must be a number in \\[-2, 2\\]"),
    ({"frequency_penalty": -2.01}, "frequency_penalty must be a number in \\[-2, 2\\]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"presence_penalty": True}, "presence_penalty"),
    ({"logit_bias": {3: 100.5}}, "logit_bias of token 3 must be a number in \\[-100, 100\\]"),
    ({"logit_bias": {3: float("inf")}}, "logit_bias of token 3"),
    ({"logit_bias": {-1: 1.0}}, "non-negative token ids"),
    ({"logit_bias": {"3": 1.0}}, "non-negative token ids"),
    ({"logit_bias": [3, 1.0]}, "must map token ids"),
    ({"num_beams": 2, "frequency_penalty": 0.5}, "not to beam search"),
    ({"num_beams": 2, "logit_bias": {1: 1}}, "not to beam search"),
], ids=["presence-high", "frequency-low", "nan", "bool", "bias-high", "bias-inf", "negative-id", "string-id",
        "not-a-mapping", "beams-penalty", "beams-bias"])
def test_bad_values_are_refused_naming_them(options, match):
    with pytest.raises(OptionError, match=match):
        GenerationConfig(**options)


def test_a_biased_id_past_the_vocabulary_is_refused_naming_it():
    with pytest.raises(InputError, match="logit_bias names token id 4, past the model's vocabulary \\(4 ids"):
        generate(FixedLogits(np.zeros(4)), [[1]], logit_bias={2: 1.0, 4: 1.0})
