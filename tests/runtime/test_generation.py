"""The generation loop against oracles written elsewhere: transformers' ``generate`` on Hugging Face GPT-2 (greedy
and beam search, token for token), transformers' logits processors of the same names, the softmax of the logits
(sampling); and the ONNX stepper (a hand-written cache-aware GPT exported by torch) against the same loop over the
module in torch."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from mha_deploy.errors import InputError, ModelFileError, OptionError
from mha_deploy.runtime import MHASession
from mha_deploy.runtime import logits as ours
from mha_deploy.runtime.generation import GenerationConfig, TokenStepper, generate, prompt_batch, stream
from mha_deploy.runtime.kv_stepper import KVCacheStepper
from mha_deploy.runtime.logits import TokenHistory
from mha_deploy.runtime.stopping import EosTokenCriteria, MaxNewTokensCriteria, StoppingCriteriaList
from tests.conftest import HOLES_LM, user_module
from tests.runtime.fixed_logits import FixedLogits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MAX_NEW = 12
PAD = 1
# One prompt, and prompts of different lengths left-padded as transformers' decoder-only models expect.
PROMPTS = {"one": [6], "left-padded": [5, 2, 7]}
SEARCHES = {
    "greedy": {},
    "greedy-penalised": {"repetition_penalty": 1.5, "min_new_tokens": 3},
    "beams": {"num_beams": 4},
    "beams-short": {"num_beams": 4, "length_penalty": 0.6},
    "beams-long": {"num_beams": 4, "length_penalty": 2.0},
    "beams-early": {"num_beams": 4, "early_stopping": True},
}


class RecomputeStepper:
    """A ``TokenStepper`` running a torch model over each row's whole prefix on every call (no cache): the
    plainest way to the next token's logits, so that a cache or row-bookkeeping bug in a stepper under test shows.
    ``rows_per_call`` records how many rows each call ran."""

    decoder_start_token_id = None

    def __init__(self, logits_of):
        self.logits_of = logits_of  # (ids, mask, positions) tensors [rows, seq] -> logits [rows, seq, vocab]
        self.rows_per_call: list[int] = []

    def prefill(self, input_ids, attention_mask):
        self.ids, self.mask = input_ids, attention_mask
        return self._logits()

    def step(self, next_ids):
        self.ids = np.concatenate([self.ids, next_ids[:, None]], axis=1)
        self.mask = np.concatenate([self.mask, np.ones((len(next_ids), 1), np.int64)], axis=1)
        return self._logits()

    def keep(self, rows):
        self.ids, self.mask = self.ids[rows], self.mask[rows]

    def _logits(self):
        self.rows_per_call.append(len(self.ids))
        mask = torch.from_numpy(self.mask)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            return self.logits_of(torch.from_numpy(self.ids), mask, positions)[:, -1].float().numpy()


class Seq2SeqRecomputeStepper:
    """The encoder-decoder form: the prompts are the source, every row's target starts at ``start``, and each call
    runs the model over the whole source and target again."""

    def __init__(self, logits_of, start: int):
        self.logits_of = logits_of  # (source ids, source mask, target ids) tensors -> logits [rows, target, vocab]
        self.decoder_start_token_id = start
        self.rows_per_call: list[int] = []

    def prefill(self, input_ids, attention_mask):
        self.source, self.mask = torch.from_numpy(input_ids), torch.from_numpy(attention_mask)
        self.target = torch.full((len(input_ids), 1), self.decoder_start_token_id)
        return self._logits()

    def step(self, next_ids):
        self.target = torch.cat([self.target, torch.from_numpy(next_ids)[:, None]], 1)
        return self._logits()

    def keep(self, rows):
        rows = torch.from_numpy(np.asarray(rows))
        self.source, self.mask, self.target = self.source[rows], self.mask[rows], self.target[rows]

    def _logits(self):
        self.rows_per_call.append(len(self.target))
        with torch.no_grad():
            return self.logits_of(self.source, self.mask, self.target)[:, -1].float().numpy()


class CountingStepper:
    """Another stepper, its calls' row counts recorded."""

    def __init__(self, inner):
        self.inner, self.decoder_start_token_id = inner, inner.decoder_start_token_id
        self.rows_per_call: list[int] = []

    def prefill(self, input_ids, attention_mask):
        self.rows_per_call.append(len(input_ids))
        return self.inner.prefill(input_ids, attention_mask)

    def step(self, next_ids):
        self.rows_per_call.append(len(next_ids))
        return self.inner.step(next_ids)

    def keep(self, rows):
        self.inner.keep(rows)


def prompts(lengths: list[int], vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random prompts of ``lengths``, left-padded with PAD (masked)."""
    rng = np.random.default_rng(seed)
    ids, mask = prompt_batch([rng.integers(2, vocab, n) for n in lengths])
    return np.where(mask == 1, ids, PAD), mask


def end_ids(tokens: list[np.ndarray]) -> list[int]:
    """Ids that end the rows of a run without them at different steps: row i's token at step 2 + 3 i."""
    return sorted({int(row[min(2 + 3 * i, len(row) - 1)]) for i, row in enumerate(tokens)})


# --- Hugging Face GPT-2: transformers' generate is the oracle ------------------------------------------------


@pytest.fixture(scope="module")
def gpt2():
    model = user_module("hf_gpt2").build()
    with torch.no_grad():  # GPT-2's initial weights (std 0.02) give near-uniform logits that repeat one token
        for parameter in model.parameters():
            parameter.mul_(5.0)
    return model


def gpt2_stepper(model) -> RecomputeStepper:
    return RecomputeStepper(lambda ids, mask, positions: model(input_ids=ids, attention_mask=mask,
                                                               position_ids=positions).logits)


def transformers_generate(model, ids, mask, **options) -> np.ndarray:
    with torch.no_grad():
        out = model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), do_sample=False,
                             max_new_tokens=MAX_NEW, pad_token_id=PAD, **options)
    return out[:, ids.shape[1] :].numpy()


@pytest.fixture(scope="module")
def gpt2_ends(gpt2):
    """Ids that end the left-padded batch's greedy rows at different steps."""
    ids, mask = prompts(PROMPTS["left-padded"], gpt2.config.vocab_size, seed=4)
    return end_ids(generate(gpt2_stepper(gpt2), ids, mask, max_new_tokens=MAX_NEW).tokens)


# Every search on the left-padded batch with and without end ids; greedy and beams on one prompt.
SEARCH_CASES = [
    *[pytest.param("left-padded", search, ends, id=f"left-padded-{search}-{'eos' if ends else 'no-eos'}")
      for search in SEARCHES for ends in (False, True)],
    *[pytest.param("one", search, True, id=f"one-{search}-eos") for search in ("greedy", "beams-short")],
]


@pytest.mark.parametrize(("batch", "search", "ends"), SEARCH_CASES)
def test_search_equals_transformers_generate(gpt2, gpt2_ends, batch, search, ends):
    ids, mask = prompts(PROMPTS[batch], gpt2.config.vocab_size, seed=4)
    eos = gpt2_ends if ends else None
    expected = transformers_generate(gpt2, ids, mask, eos_token_id=eos, **SEARCHES[search])
    out = generate(gpt2_stepper(gpt2), ids, mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=PAD,
                   **SEARCHES[search])
    np.testing.assert_array_equal(out.padded(expected.shape[1]), expected)
    if ends and search == "greedy" and batch == "left-padded":  # the case exercises rows leaving at different steps
        assert len({len(tokens) for tokens in out.tokens}) == 3, [t.tolist() for t in out.tokens]


def test_finished_rows_leave_the_batch(gpt2, gpt2_ends):
    ids, mask = prompts(PROMPTS["left-padded"], gpt2.config.vocab_size, seed=4)
    eos = gpt2_ends
    stepper = gpt2_stepper(gpt2)
    out = generate(stepper, ids, mask, max_new_tokens=MAX_NEW, eos_token_id=eos)
    lengths = [len(t) for t in out.tokens]
    # Call k (0: the prefill) runs the rows that have generated k tokens and not ended.
    assert stepper.rows_per_call == [sum(n > k for n in lengths) for k in range(max(lengths))]


def test_stream_yields_what_generate_returns(gpt2, gpt2_ends):
    ids, mask = prompts(PROMPTS["left-padded"], gpt2.config.vocab_size, seed=4)
    eos = gpt2_ends
    expected = generate(gpt2_stepper(gpt2), ids, mask, max_new_tokens=MAX_NEW, eos_token_id=eos).tokens
    streamed: list[list[int]] = [[] for _ in expected]
    for step in stream(gpt2_stepper(gpt2), ids, mask, max_new_tokens=MAX_NEW, eos_token_id=eos):
        for prompt, token, finished in zip(step.prompts, step.tokens, step.finished, strict=True):
            assert not streamed[prompt] or streamed[prompt][-1] not in eos  # nothing after a row's end
            streamed[prompt].append(int(token))
            assert finished == (len(streamed[prompt]) == len(expected[prompt]))
    assert streamed == [t.tolist() for t in expected]


# --- Hugging Face BART: an encoder-decoder starts from its decoder start id ----------------------------------

SEQ2SEQ_SEARCHES = ("greedy", "greedy-penalised", "beams", "beams-short")


@pytest.fixture(scope="module")
def bart():
    model = user_module("hf_seq2seq").build_bart()
    with torch.no_grad():  # as GPT-2's: initial weights give near-uniform logits
        for parameter in model.parameters():
            parameter.mul_(5.0)
    return model


def bart_stepper(model) -> Seq2SeqRecomputeStepper:
    return Seq2SeqRecomputeStepper(
        lambda source, mask, target: model(input_ids=source, attention_mask=mask, decoder_input_ids=target).logits,
        model.config.decoder_start_token_id,
    )


@pytest.mark.parametrize("ends", [False, True], ids=["no-eos", "eos"])
@pytest.mark.parametrize("search", SEQ2SEQ_SEARCHES)
def test_encoder_decoder_search_equals_transformers_generate(bart, search, ends):
    ids, mask = prompts(PROMPTS["left-padded"], bart.config.vocab_size, seed=4)
    eos = end_ids(generate(bart_stepper(bart), ids, mask, max_new_tokens=MAX_NEW).tokens) if ends else None
    with torch.no_grad():  # BART's config forces its eos id at the last step: not a rule this loop has
        expected = bart.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                                 do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=PAD,
                                 forced_eos_token_id=None, **SEARCHES[search])
    expected = expected[:, 1:].numpy()  # transformers returns the start id first
    out = generate(bart_stepper(bart), ids, mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=PAD,
                   **SEARCHES[search])
    np.testing.assert_array_equal(out.padded(expected.shape[1]), expected)


# --- the ONNX stepper: a cache-aware GPT exported by torch, against the same loop over the module in torch ---


@pytest.fixture(scope="module")
def cached_gpt(tmp_path_factory):
    from tests.runtime import cached_gpt

    model = cached_gpt.build(seed=0)
    path = tmp_path_factory.mktemp("generation") / "cached_gpt.onnx"
    cached_gpt.export(model, path)
    empty = [torch.zeros(1, cached_gpt.HEADS, 0, cached_gpt.HEAD_DIM)] * (2 * cached_gpt.LAYERS)

    def logits_of(ids, mask, positions):
        return model(ids, mask, positions, *(e.expand(len(ids), -1, -1, -1) for e in empty))[0]

    return path, logits_of, cached_gpt.VOCAB


ORT_SEARCHES = {
    "greedy": {},
    "beams": {"num_beams": 4, "length_penalty": 0.6},
    "sampled": {"do_sample": True, "temperature": 0.8, "top_k": 10, "top_p": 0.95, "seed": 7},
}


@pytest.mark.parametrize("search", ORT_SEARCHES)
def test_onnx_cache_equals_the_torch_loop(cached_gpt, search):
    path, logits_of, vocab = cached_gpt
    ids, mask = prompts(PROMPTS["left-padded"], vocab, seed=5)
    eos = end_ids(generate(RecomputeStepper(logits_of), ids, mask, max_new_tokens=MAX_NEW).tokens)
    options = {"max_new_tokens": MAX_NEW, "eos_token_id": eos, **ORT_SEARCHES[search]}
    torch_stepper = RecomputeStepper(logits_of)
    expected = generate(torch_stepper, ids, mask, **options)
    onnx_stepper = CountingStepper(KVCacheStepper(path))
    out = generate(onnx_stepper, ids, mask, **options)
    assert [t.tolist() for t in out.tokens] == [t.tolist() for t in expected.tokens]
    assert onnx_stepper.rows_per_call == torch_stepper.rows_per_call  # rows leave (and beams move) alike
    if search == "greedy":
        assert min(onnx_stepper.rows_per_call) < len(ids)  # some row ended early and left


@pytest.fixture(scope="module")
def cached_seq2seq(seq2seq):
    from tests.runtime import cached_seq2seq

    # the modules conftest's seq2seq exported (build(seed=1)), its files exported once per run
    encoder, decoder = cached_seq2seq.build(seed=1)
    folder = seq2seq[0].parent
    empty = torch.zeros(1, cached_seq2seq.HEADS, 0, cached_seq2seq.HEAD_DIM)

    def logits_of(source, mask, target):
        caches = tuple(empty.expand(len(target), -1, -1, -1) for _ in range(4 * cached_seq2seq.LAYERS))
        return decoder(target, mask, encoder(source, mask), caches)[0]

    return folder, logits_of, cached_seq2seq.START_ID


@pytest.mark.parametrize("search", ["greedy", "beams"])
def test_onnx_encoder_decoder_equals_the_torch_loop(cached_seq2seq, search):
    folder, logits_of, start = cached_seq2seq
    ids, mask = prompts(PROMPTS["left-padded"], 64, seed=6)
    eos = end_ids(generate(Seq2SeqRecomputeStepper(logits_of, start), ids, mask, max_new_tokens=MAX_NEW).tokens)
    options = {"max_new_tokens": MAX_NEW, "eos_token_id": eos, **ORT_SEARCHES[search]}
    torch_stepper = Seq2SeqRecomputeStepper(logits_of, start)
    expected = generate(torch_stepper, ids, mask, **options)
    onnx_stepper = CountingStepper(KVCacheStepper(folder / "decoder.onnx", encoder=folder / "encoder.onnx",
                                                  decoder_start_token_id=start))
    out = generate(onnx_stepper, ids, mask, **options)
    assert [t.tolist() for t in out.tokens] == [t.tolist() for t in expected.tokens]
    assert onnx_stepper.rows_per_call == torch_stepper.rows_per_call


def test_encoder_caches_are_computed_once_and_passed_back(cached_seq2seq):
    folder, _, start = cached_seq2seq
    stepper = KVCacheStepper(folder / "decoder.onnx", encoder=folder / "encoder.onnx", decoder_start_token_id=start)
    ids, mask = prompts([4, 2], 64, seed=6)
    stepper.prefill(ids, mask)
    encoder_key = stepper.past["past_key_values.1.encoder.key"]
    assert encoder_key.shape[2] == ids.shape[1]  # the source's length, not the target's
    stepper.step(np.array([3, 4]))
    assert stepper.past["past_key_values.1.encoder.key"] is encoder_key
    assert stepper.past["past_key_values.1.decoder.key"].shape[2] == 2
    stepper.keep(np.array([1]))
    assert stepper.past["past_key_values.1.encoder.key"].shape[0] == 1
    assert stepper.encoder_feeds["encoder_hidden_states"].shape[0] == 1


def test_an_encoder_decoder_needs_its_encoder_and_start_id(cached_seq2seq):
    folder = cached_seq2seq[0]
    with pytest.raises(OptionError, match="encoder"):
        KVCacheStepper(folder / "decoder.onnx", decoder_start_token_id=2)
    with pytest.raises(OptionError, match="cross-attention"):
        KVCacheStepper(folder / "decoder.onnx", num_heads=4, head_dim=8)


def right_padded(ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same prompts with their real tokens first."""
    order = np.argsort(mask == 0, axis=1, kind="stable")
    return np.take_along_axis(ids, order, axis=1), np.take_along_axis(mask, order, axis=1)


@pytest.mark.parametrize("search", ["greedy", "beams"])
def test_right_padded_prompts_generate_what_left_padded_ones_do(cached_gpt, search):
    """The cache keeps a right-padded row's padding as holes before its new tokens; the positions the stepper
    feeds count real tokens only, so the tokens are those of the same prompts padded on the left."""
    path, _, vocab = cached_gpt
    ids, mask = prompts(PROMPTS["left-padded"], vocab, seed=5)
    options = {"max_new_tokens": MAX_NEW, **ORT_SEARCHES[search]}
    expected = generate(KVCacheStepper(path), ids, mask, **options)
    out = generate(KVCacheStepper(path), *right_padded(ids, mask), **options)
    assert [t.tolist() for t in out.tokens] == [t.tolist() for t in expected.tokens]


def test_padding_holes_are_zeros_in_the_cache(cached_gpt):
    stepper = KVCacheStepper(cached_gpt[0])
    ids, mask = prompts([4, 2, 3], cached_gpt[2], seed=5)
    stepper.prefill(*right_padded(ids, mask))
    holes = stepper.mask == 0
    for cache in stepper.past.values():
        assert not cache.transpose(0, 2, 1, 3)[holes].any() and cache.transpose(0, 2, 1, 3)[~holes].all()


def test_leaving_rows_free_their_cache_and_unused_columns(cached_gpt):
    path, _, vocab = cached_gpt
    stepper = KVCacheStepper(path)
    ids, mask = prompts([7, 2, 3], vocab, seed=5)
    stepper.prefill(ids, mask)
    stepper.step(np.array([3, 4, 5]))
    stepper.keep(np.array([1, 2]))  # the 7-token row leaves: the 4 columns only it used go with it
    assert stepper.mask.shape == (2, 4) and stepper.mask.all(axis=0).any()
    assert {cache.shape[:3] for cache in stepper.past.values()} == {(2, 4, 4)}
    stepper.keep(np.array([1, 1, 0]))  # beams: rows repeated and reordered
    assert {cache.shape[0] for cache in stepper.past.values()} == {3}
    np.testing.assert_array_equal(stepper.past["past_key_values.0.key"][0], stepper.past["past_key_values.0.key"][1])


def test_onnx_stepper_is_a_token_stepper(cached_gpt):
    stepper = KVCacheStepper(cached_gpt[0])
    assert isinstance(stepper, TokenStepper)
    assert isinstance(stepper.graph.session, ort.InferenceSession)  # no mha-deploy metadata: plain ORT on the CPU


def test_ids_past_the_vocabulary_are_refused_naming_the_prompt(cached_gpt):
    path, _, vocab = cached_gpt
    with pytest.raises(InputError, match=rf"prompts \[1\] hold token ids past the vocabulary .*{vocab} ids"):
        generate(KVCacheStepper(path), [[3, 4], [5, vocab]])


def test_a_file_without_a_cache_is_refused(tmp_path):
    from onnx import TensorProto, helper, save

    value = [helper.make_tensor_value_info(n, TensorProto.INT64, ["b", "s"]) for n in ("input_ids", "logits")]
    graph = helper.make_graph([helper.make_node("Identity", ["input_ids"], ["logits"])], "g", value[:1], value[1:])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    save(model, tmp_path / "plain.onnx")
    with pytest.raises(ModelFileError, match="past_key_values"):
        KVCacheStepper(tmp_path / "plain.onnx")


# --- sampling ----------------------------------------------------------------------------------------------


def test_sampling_with_a_seed_is_reproducible(cached_gpt):
    _, logits_of, vocab = cached_gpt
    ids, mask = prompts(PROMPTS["left-padded"], vocab, seed=5)

    def sample(seed):
        out = generate(RecomputeStepper(logits_of), ids, mask, max_new_tokens=MAX_NEW, do_sample=True, seed=seed)
        return [t.tolist() for t in out.tokens]

    assert sample(3) == sample(3)
    assert sample(3) != sample(4)




# Chi-square critical values at p = 0.001 by degrees of freedom: a correct sampler fails one in a thousand seeds,
# and this seed is fixed.
CHI2_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124, 9: 27.877}
DRAWS = 20_000


@pytest.mark.parametrize("options", [{}, {"temperature": 0.7, "top_k": 5}, {"top_p": 0.8}, {"temperature": 1.6}],
                         ids=["plain", "temperature-top-k", "top-p", "hot"])
def test_sampled_tokens_follow_the_softmax_of_the_processed_logits(options):
    logits = np.random.default_rng(0).normal(0, 1.5, 8).astype(np.float32)
    config = GenerationConfig(do_sample=True, max_new_tokens=1, seed=11, **options)
    out = generate(FixedLogits(logits), np.zeros((DRAWS, 1), np.int64), config=config)
    counts = np.bincount(np.concatenate(out.tokens), minlength=len(logits))
    scores = config.logits_processors()(TokenHistory(np.zeros((1, 1), np.int64), 0), logits[None])[0]
    expected = np.exp(ours.log_softmax(scores)) * DRAWS
    kept = expected > 0
    assert counts[~kept].sum() == 0, "a filtered token was drawn"
    chi2 = float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())
    assert chi2 < CHI2_P001[int(kept.sum()) - 1], (chi2, counts, expected.round())


# --- each logits processor against transformers' processor of the same name ----------------------------------

ROWS, VOCAB, LENGTH, GENERATED = 4, 50, 9, 3


def history() -> TokenHistory:
    """Rows of a left-padded batch (-1 = padding) that have generated GENERATED tokens each."""
    tokens = np.random.default_rng(2).integers(0, VOCAB, (ROWS, LENGTH))
    for row, pads in enumerate([0, 2, 4, 1]):
        tokens[row, :pads] = -1
    return TokenHistory(tokens, GENERATED)


def theirs_repetition(penalty):
    # generate ignores each row's leading padding, counted from the attention mask.
    pads = torch.from_numpy((history().tokens < 0).sum(axis=1))
    return transformers.RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=pads)


PROCESSORS = {
    "TemperatureLogitsWarper": (lambda: ours.TemperatureLogitsWarper(0.7),
                                lambda: transformers.TemperatureLogitsWarper(0.7)),
    "TopKLogitsWarper": (lambda: ours.TopKLogitsWarper(5), lambda: transformers.TopKLogitsWarper(5)),
    "TopKLogitsWarper-keep": (lambda: ours.TopKLogitsWarper(1, min_tokens_to_keep=3),
                              lambda: transformers.TopKLogitsWarper(1, min_tokens_to_keep=3)),
    "TopPLogitsWarper": (lambda: ours.TopPLogitsWarper(0.8), lambda: transformers.TopPLogitsWarper(0.8)),
    "TopPLogitsWarper-keep": (lambda: ours.TopPLogitsWarper(0.05, min_tokens_to_keep=2),
                              lambda: transformers.TopPLogitsWarper(0.05, min_tokens_to_keep=2)),
    "RepetitionPenaltyLogitsProcessor": (lambda: ours.RepetitionPenaltyLogitsProcessor(1.3),
                                         lambda: theirs_repetition(1.3)),
    "RepetitionPenaltyLogitsProcessor-reward": (lambda: ours.RepetitionPenaltyLogitsProcessor(0.6),
                                                lambda: theirs_repetition(0.6)),
    "MinNewTokensLengthLogitsProcessor-before": (
        lambda: ours.MinNewTokensLengthLogitsProcessor(GENERATED + 1, [2, 7]),
        lambda: transformers.MinNewTokensLengthLogitsProcessor(LENGTH - GENERATED, GENERATED + 1, [2, 7])),
    "MinNewTokensLengthLogitsProcessor-after": (
        lambda: ours.MinNewTokensLengthLogitsProcessor(GENERATED, [2, 7]),
        lambda: transformers.MinNewTokensLengthLogitsProcessor(LENGTH - GENERATED, GENERATED, [2, 7])),
}


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("name", PROCESSORS)
def test_processor_equals_transformers_namesake(name, ties):
    make_ours, make_theirs = PROCESSORS[name]
    scores = np.random.default_rng(3).normal(0, 3, (ROWS, VOCAB)).astype(np.float32)
    if ties:  # equal scores at the cut of top-k and top-p
        scores = np.round(scores)
    tokens = history().tokens
    expected = make_theirs()(torch.from_numpy(np.where(tokens < 0, 0, tokens)), torch.from_numpy(scores.copy()))
    before = scores.copy()
    result = make_ours()(history(), scores)
    np.testing.assert_array_equal(scores, before)  # the input is left as it was
    expected = expected.numpy()
    if ties and name.startswith("TopP"):
        # Which of equal scores at the cut goes is torch.sort's order there, not a stable one: compare what is
        # kept as multisets of scores per row.
        for kept, kept_expected in zip(np.sort(result, axis=1), np.sort(expected, axis=1), strict=True):
            np.testing.assert_array_equal(kept, kept_expected)
        return
    np.testing.assert_allclose(result, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_beam_candidates_are_a_stable_sort_of_the_scores(ties):
    from mha_deploy.runtime.beam_search import _best

    values = np.random.default_rng(8).normal(0, 2, (5, 400)).astype(np.float32)
    values[1, :50] = -np.inf
    if ties:
        values = np.round(values)
    for k in (1, 8, 400):
        np.testing.assert_array_equal(_best(values, k), np.argsort(-values, axis=1, kind="stable")[:, :k])


def test_log_softmax_equals_torch():
    scores = np.random.default_rng(1).normal(0, 4, (3, 20)).astype(np.float32)
    scores[0, :5] = -np.inf
    expected = torch.log_softmax(torch.from_numpy(scores), -1).numpy()
    np.testing.assert_allclose(ours.log_softmax(scores), expected, rtol=1e-5, atol=1e-5)


def test_stopping_criteria():
    tokens = np.array([[5, 2], [5, 3], [5, 9]])
    criteria = StoppingCriteriaList([EosTokenCriteria([2, 9])])
    np.testing.assert_array_equal(criteria(TokenHistory(tokens, 1)), [True, False, True])
    criteria.append(MaxNewTokensCriteria(2))
    np.testing.assert_array_equal(criteria(TokenHistory(tokens, 1)), [True, False, True])
    assert criteria(TokenHistory(tokens, 2)).all()
    # What the search asks after every token: the same rows, or None where no row is finished (no array made).
    np.testing.assert_array_equal(criteria.finished(TokenHistory(tokens, 1)), [True, False, True])
    assert criteria.finished(TokenHistory(tokens[1:2], 1)) is None
    assert criteria.finished(TokenHistory(tokens[1:2], 2)).tolist() == [True]


@pytest.mark.parametrize("eos", [[2], [9, 2]])
def test_one_end_id_and_several_stop_the_same_rows(eos):
    """One end id is compared as a scalar, several broadcast: the rows they finish are the same."""
    tokens = np.array([[5, 2], [5, 3], [2, 9], [2, 4]])
    expected = np.isin(tokens[:, -1], eos)
    np.testing.assert_array_equal(EosTokenCriteria(eos)(TokenHistory(tokens, 1)), expected)
    np.testing.assert_array_equal(EosTokenCriteria(eos).finished(TokenHistory(tokens, 1)), expected)
    assert EosTokenCriteria(eos).finished(TokenHistory(tokens[[1, 3]], 1)) is None
    for row in range(len(tokens)):  # one row, as batch-1 decoding asks
        said = EosTokenCriteria(eos).finished(TokenHistory(tokens[row : row + 1], 1))
        assert (said is not None and said.tolist() == [True]) if expected[row] else said is None


# --- bad options and inputs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [
    {"max_new_tokens": 0}, {"min_new_tokens": 30, "max_new_tokens": 5}, {"num_beams": 0},
    {"num_beams": 2, "do_sample": True}, {"do_sample": True, "temperature": 0.0}, {"do_sample": True, "top_p": 1.5},
    {"do_sample": True, "top_k": -1}, {"repetition_penalty": 0.0}, {"early_stopping": "sometimes"},
    {"eos_token_id": -3}, {"beams": 4},
], ids=lambda o: ",".join(o))
def test_bad_options_are_refused_before_any_call(options):
    with pytest.raises(OptionError):
        generate(FixedLogits(np.zeros(4)), [[1, 2]], **options)


@pytest.mark.parametrize(("prompts_given", "match"), [
    ([[1, 2], []], "empty"), (np.zeros((0, 3), np.int64), "no prompt"), (np.array([[1.5, 2.0]]), "integer"),
    ([[1, -2]], "non-negative"), ([[1, 2], [1.5]], "prompt 1 must hold integer"),
])
def test_bad_prompts_are_refused(prompts_given, match):
    with pytest.raises(InputError, match=match):
        generate(FixedLogits(np.zeros(4)), prompts_given)


def test_beam_search_cannot_stream():
    with pytest.raises(OptionError, match="stream"):
        stream(FixedLogits(np.zeros(4)), [[1, 2]], num_beams=2)


# --- an mha-deploy KV-cache export of a user's causal LM (export --module --kv-cache), opened as an MHASession:
# greedy is held to the module in tests/exporters/test_own_kv_cache.py; here beams and sampling, rows ending at
# different steps (ragged: rows swap-removed from buffers ORT writes in place; holes: their cache rows and unused
# columns dropped while MHASession validates every call) ---


@pytest.fixture(scope="module", params=["ragged", "holes"])
def own_lm(tmp_path_factory, request):
    """Both layouts ``export --kv-cache`` writes: ragged (its default) and ``--cache-layout holes``."""
    from mha_deploy.exporters import export_model

    module = user_module("causal_lm")
    path = tmp_path_factory.mktemp("generation-own") / f"lm-{request.param}.onnx"
    export_model(module.build(), path, module.INPUTS, kv_cache=True, cache_layout=request.param)
    assert KVCacheStepper(path).cache_layout == request.param
    model = module.build().eval()

    def logits_of(ids, mask, positions):
        return model(ids, mask.bool())

    return path, logits_of


@pytest.mark.parametrize("search", ["beams", "sampled"])
def test_generate_over_an_own_model_kv_cache_export(own_lm, search):
    path, logits_of = own_lm
    ids, mask = prompts([9, 2, 4, 6], 50, seed=5)
    eos = end_ids(generate(RecomputeStepper(logits_of), ids, mask, max_new_tokens=MAX_NEW).tokens)
    options = {"max_new_tokens": MAX_NEW, "eos_token_id": eos, **ORT_SEARCHES[search]}
    torch_stepper = RecomputeStepper(logits_of)
    expected = generate(torch_stepper, ids, mask, **options)
    stepper = KVCacheStepper(path)
    assert isinstance(stepper.graph.session, MHASession)  # an mha-deploy file: inputs checked on its metadata
    counting = CountingStepper(stepper)
    out = generate(counting, ids, mask, **options)
    assert [t.tolist() for t in out.tokens] == [t.tolist() for t in expected.tokens]
    assert counting.rows_per_call == torch_stepper.rows_per_call


# --- A rotary decoder (Hugging Face Llama, as from_pretrained gives it): transformers' generate is the oracle ----


@pytest.mark.parametrize("padding", ["left", "right"])
def test_a_rotary_decoders_mixed_length_batch_gives_each_prompt_its_greedy_tokens_alone(lm_cache, padding):
    """The tiny Llama's `--kv-cache` export with the defaults, prompts of four lengths in one batch: a right-padded
    prompt's next tokens sit past a hole, which rotary would see as distance if positions counted the padded
    columns; each row's tokens equal transformers' greedy generate on that prompt alone."""
    llama = user_module("hf_llama")
    path, _ = lm_cache("hf_llama")
    model = llama.build()
    ids, mask = prompts([3, 9, 1, 6], model.config.vocab_size, seed=37)
    if padding == "right":
        ids, mask = right_padded(ids, mask)
    out = generate(KVCacheStepper(path), ids, mask, max_new_tokens=MAX_NEW, eos_token_id=llama.EOS_ID)
    for row, tokens in enumerate(out.tokens):
        prompt = ids[row][mask[row] == 1][None]
        alone = transformers_generate(model, prompt, np.ones_like(prompt), eos_token_id=llama.EOS_ID)[0]
        assert tokens.tolist() == alone.tolist(), f"row {row}"


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("search", [{}, {"num_beams": 2}], ids=["greedy", "beams"])
def test_a_file_counting_positions_by_column_generates_each_length_as_alone(lm_cache, padding, search):
    """GPT-2's holes export takes no position_ids: its positions are the padded batch's columns, so a padded row
    would be shifted (left) or split by a hole (right). generate runs such a batch one length at a time, each
    prompt unpadded, and every prompt gets what it gets alone, in the order given."""
    pytest.importorskip("transformers")
    path, _ = lm_cache("hf_gpt2", *HOLES_LM)
    stepper = KVCacheStepper(path)
    assert stepper.graph.positions == "padded-width"
    ids, mask = prompts([4, 9, 4, 1], 96, seed=11)
    if padding == "right":
        ids, mask = right_padded(ids, mask)
    options = {"max_new_tokens": 6, "eos_token_id": [], **search}
    out = generate(stepper, ids, mask, **options)
    for row, tokens in enumerate(out.tokens):
        alone = generate(KVCacheStepper(path), [ids[row][mask[row] == 1]], **options)
        assert tokens.tolist() == alone.tokens[0].tolist(), f"row {row}"
        if search:
            assert out.scores[row] == pytest.approx(alone.scores[0])
    if not search:
        with pytest.raises(InputError, match="stream prompts of one length, unpadded"):
            next(iter(stream(stepper, ids, mask, **options)))
