"""Generation over a dataset of prompts: ``mha-deploy generate``'s library side. No torch.

Prompts are read from JSONL (``{"id": ..., "input_ids": [...]}``, or ``{"id": ..., "prompt": "..."}`` with a
Hugging Face ``tokenizers`` tokenizer), npz (``<id>`` -> int ids [seq]) or Parquet (columns ``id`` and
``input_ids`` or ``prompt``); an encoder-decoder's JSONL line or Parquet row may add ``"decoder_prompt"`` (the ids
its decoder starts from: Whisper's task tokens, a target language id). Each window of ``bucket_window`` prompts is
cut into batches by the one planner (``batch.planner``), sorted by length, within ``batch_size`` rows and
``max_batch_tokens`` cache positions (rows x (longest prompt + max_new_tokens): what the batch's KV cache may grow
to); each batch is one call of the torch-free loop (``runtime.generation.generate``) over a ``TokenStepper``.
Outputs are JSONL lines ``{"id": ..., "output_ids": [...], "text": ...}`` (the new tokens only; ``text`` with a
tokenizer), in input order, one output file per input shard (``<stem>.jsonl``). Shards are run, locked, recorded and
resumed by ``batch.job`` (``DatasetJob``, ``run_shards``): a killed run's rerun skips the finished shards and
redoes the others from their start, so its outputs are byte for byte those of an uninterrupted run (sampling
included: batch ``b`` of a shard samples with ``seed + b`` (modulo 2**64), and the plan depends only on the
prompts and options).
"""

from __future__ import annotations

import functools
import json
import os
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from mha_deploy.atomic import atomic_path, stale_temporaries
from mha_deploy.batch.base import refuse_padding_masks
from mha_deploy.batch.datasets import Shard
from mha_deploy.batch.items import read_arrays
from mha_deploy.batch.job import DatasetJob, run_shards
from mha_deploy.batch.jsonl import id_problem, jsonl_records, record_problem
from mha_deploy.batch.lock import OutputError
from mha_deploy.batch.planner import BatchLimits, plan_batches
from mha_deploy.batch.ray_engine import RayOptions, run_shards_on_ray
from mha_deploy.batch.runner import BatchCallback, ItemError, RunStats
from mha_deploy.batching import RunnerOptions
from mha_deploy.errors import InputError, MHADeployError
from mha_deploy.runtime.digest import sha256_digest
from mha_deploy.runtime.generation import (
    GenerationConfig,
    TokenStepper,
    generate,
    prompt_batch,
    vocab_size,
)
from mha_deploy.runtime.kv_stepper import mixes_lengths_exactly
from mha_deploy.seeds import offset_seed
from mha_deploy.signature import PADDING_MASK, TOKENS, Signature, TensorSpec

PROMPT_SUFFIXES = (".jsonl", ".npz", ".safetensors", ".parquet")
# The arrays formats: an item per key, token ids [seq] or an encoder's features (Whisper's [mel, frames]).
ARRAY_SUFFIXES = (".npz", ".safetensors")
OUTPUT_SUFFIX = ".jsonl"



def _prompt_signature(paddable: bool) -> Signature:
    """What the planner sees of a prompt: token ids on one length axis, which prompts of different lengths may
    share (padded) or not (a batch then holds prompts of one length)."""
    return Signature.custom(
        (TensorSpec("input_ids", TOKENS, "int64", ("batch", "seq")),
         TensorSpec("attention_mask", PADDING_MASK, "bool", ("batch", "seq"), marks="input_ids")),
        (TensorSpec("output_ids", TOKENS, "int64", ("batch", "new_seq")),),
        paddable=("seq",) if paddable else (),
    )


PADDED_PROMPTS, EQUAL_PROMPTS = _prompt_signature(True), _prompt_signature(False)
# A prompt file naming one of these (a tokenizer's attention_mask kept beside the ids) is refused, as infer refuses
# it: prompts are unpadded and each batch's mask is built from their lengths, so the padding it marks would be
# read as real tokens.
PROMPT_MASKS = tuple(PADDED_PROMPTS.padding_masks)


@dataclass(frozen=True)
class Prompt:
    """One prompt as read: its id as the input gave it, its token ids int64 [seq], or why it cannot run; an
    encoder-decoder's ``decoder_prompt`` int64 [length] where the item gave one (JSONL ``"decoder_prompt"``)."""

    id: object
    input_ids: np.ndarray | None
    problem: str | None = None
    decoder_prompt: np.ndarray | None = None

    @property
    def label(self) -> str:
        return f"prompt {self.id!r}"


class PromptTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer (``tokenizer.json``): text to ids for prompts, ids to text."""

    def __init__(self, path: str | os.PathLike):
        from tokenizers import Tokenizer

        self.path = Path(path)
        try:
            self.tokenizer = Tokenizer.from_file(str(self.path))
        except Exception as exc:  # a missing file, or not the tokenizers format
            raise InputError(f"{self.path}: not a tokenizers tokenizer.json ({exc})") from exc

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text).ids, np.int64)

    def decode(self, ids: np.ndarray) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


# --- reading ---------------------------------------------------------------------------------------


def read_prompts(path: Path, tokenizer: PromptTokenizer | None = None) -> Iterator[Prompt]:
    """The prompts of one shard, in file order; an unusable one comes with its problem, not as an exception. A
    file holding a padding mask (``PROMPT_MASKS``) is refused whole: an ``InputError`` naming the key, column or
    line."""
    if path.suffix == ".jsonl":
        return _jsonl_prompts(path, tokenizer)
    if path.suffix in ARRAY_SUFFIXES:
        arrays = read_arrays(path)
        refuse_padding_masks(path, arrays, PROMPT_MASKS, "key")
        return (_array_prompt(key, ids) for key, ids in arrays.items())
    return _parquet_prompts(path, tokenizer)


def count_prompts(path: Path) -> int:
    """Prompts in one shard, without tokenizing them. The run counts every shard before it writes anything, so a
    shard holding a padding mask is refused here, as ``read_prompts`` refuses it."""
    if path.suffix == ".jsonl":
        return sum(1 for _ in jsonl_records(path, PROMPT_MASKS))
    if path.suffix == ".safetensors":
        names = list(read_arrays(path))
        refuse_padding_masks(path, names, PROMPT_MASKS, "key")
        return len(names)
    try:
        if path.suffix == ".npz":
            with zipfile.ZipFile(path) as archive:
                names = [name.removesuffix(".npy") for name in archive.namelist()]  # np.load's keys
        else:
            import pyarrow.parquet as pq

            file = pq.ParquetFile(path)
            names, rows = file.schema_arrow.names, file.metadata.num_rows
    except Exception as exc:  # zipfile's or pyarrow's refusal of a damaged file
        raise InputError(f"{path}: cannot read it ({type(exc).__name__}: {exc})") from exc
    if path.suffix == ".npz":
        refuse_padding_masks(path, names, PROMPT_MASKS, "key")
        return len(names)
    refuse_padding_masks(path, names, PROMPT_MASKS, "column")
    return rows


def _jsonl_prompts(path: Path, tokenizer: PromptTokenizer | None) -> Iterator[Prompt]:
    for number, record in jsonl_records(path, PROMPT_MASKS):
        if (problem := record_problem(number, record)) is not None:
            yield Prompt(f"line {number}", None, problem)
        else:
            yield _record_prompt(record, tokenizer)


def _parquet_prompts(path: Path, tokenizer: PromptTokenizer | None) -> Iterator[Prompt]:
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except Exception as exc:
        raise InputError(f"{path}: cannot read it as Parquet ({exc})") from exc
    names = file.schema_arrow.names
    refuse_padding_masks(path, names, PROMPT_MASKS, "column")
    if "id" not in names or not {"input_ids", "prompt"} & set(names):
        raise InputError(f"{path}: needs columns id and input_ids (list of int) or prompt (string), has {names}")
    columns = ["id", *(name for name in ("input_ids", "prompt", "decoder_prompt") if name in names)]
    batches = file.iter_batches(batch_size=1024, columns=columns)
    row = 0
    while True:
        try:
            batch = next(batches, None)
        except Exception as exc:  # a damaged row group: pyarrow's error, named here
            raise InputError(f"{path}: cannot read it ({type(exc).__name__}: {exc})") from exc
        if batch is None:
            return
        for record in batch.to_pylist():
            row += 1
            if (problem := id_problem(record["id"])) is not None:
                yield Prompt(f"row {row}", None, f"row {row}: {problem}")
                continue
            yield _record_prompt({k: v for k, v in record.items() if v is not None}, tokenizer)


def _record_prompt(record: dict, tokenizer: PromptTokenizer | None) -> Prompt:
    """A JSON line's or Parquet row's prompt: ``input_ids`` as given, or ``prompt`` through the tokenizer."""
    item_id = record["id"]
    label = f"prompt {item_id!r}"
    if ("input_ids" in record) == ("prompt" in record):
        return Prompt(item_id, None, f"{label}: give \"input_ids\" (token ids) or \"prompt\" (text), one of them")
    if "prompt" in record:
        if not isinstance(record["prompt"], str):
            return Prompt(item_id, None, f"{label}: \"prompt\" must be text")
        if tokenizer is None:
            return Prompt(item_id, None, f"{label}: a text prompt needs --tokenizer tokenizer.json to become ids")
        return _with_decoder_prompt(Prompt(item_id, tokenizer.encode(record["prompt"])), record)
    ids = record["input_ids"]
    if not _id_list(ids):
        return Prompt(item_id, None, f"{label}: \"input_ids\" must be a list of integer token ids")
    return _with_decoder_prompt(Prompt(item_id, np.asarray(ids, np.int64)), record)


def _id_list(ids) -> bool:
    return isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)


def _with_decoder_prompt(prompt: Prompt, record: dict) -> Prompt:
    """``prompt`` with the record's ``"decoder_prompt"`` (an encoder-decoder's decoder's first ids), if it has one."""
    if "decoder_prompt" not in record:
        return prompt
    ids = record["decoder_prompt"]
    if not _id_list(ids):
        return Prompt(prompt.id, None, f"{prompt.label}: \"decoder_prompt\" must be a list of integer token ids")
    return replace(prompt, decoder_prompt=np.asarray(ids, np.int64))


def _array_prompt(key: str, ids: np.ndarray) -> Prompt:
    if ids.ndim >= 2 and ids.dtype.kind == "f":  # an encoder's features: checked against its sizes (PromptLimits)
        return Prompt(key, ids)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        return Prompt(key, None, f"prompt {key!r}: must be integer token ids [seq] (or an encoder's float features), "
                                 f"got {ids.dtype} {ids.shape}")
    return Prompt(key, ids.astype(np.int64))


def list_prompt_shards(input_path: Path, output_path: Path) -> list[Shard]:
    """One prompt file -> ``output_path`` (.jsonl), or a directory's prompt files -> ``output_path/<stem>.jsonl``."""
    input_path, output_path = Path(input_path), Path(output_path)
    if input_path.is_dir():
        if output_path.exists() and not output_path.is_dir():
            raise InputError(f"--input {input_path} is a directory, so --output must be one too")
        paths = sorted(p for p in input_path.iterdir()
                       if p.is_file() and p.suffix in PROMPT_SUFFIXES and not p.name.startswith((".", "_")))
        if not paths:
            raise InputError(f"{input_path}: no {', '.join(PROMPT_SUFFIXES)} files in this directory")
        outputs = [p.stem + OUTPUT_SUFFIX for p in paths]
        if len(set(outputs)) < len(outputs):
            raise InputError(f"{input_path}: two prompt files share a stem, so their outputs would share a name")
        return [Shard(p.name, p, output_path / name) for p, name in zip(paths, outputs, strict=True)]
    if not input_path.is_file():
        raise InputError(f"input file not found: {input_path}")
    if input_path.suffix not in PROMPT_SUFFIXES:
        raise InputError(f"input file {input_path} must end in {' or '.join(PROMPT_SUFFIXES)}")
    if output_path.suffix != OUTPUT_SUFFIX:
        raise InputError(f"output file {output_path} must end in {OUTPUT_SUFFIX} (one JSON line per prompt)")
    return [Shard(input_path.name, input_path, output_path)]


# --- running ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptLimits:
    """What a prompt may hold: ids in ``[0, vocab)`` (None: not known) and, with ``max_length``, at most
    ``max_length - max_new_tokens`` tokens, so that the prompt and its new tokens fit the model (an encoder's
    source: ``max_length`` tokens, ``with_new_tokens`` False). ``length_from`` says where the limit came from."""

    vocab: int | None = None
    max_length: int | None = None
    with_new_tokens: bool = True
    length_from: str = "--max-length"
    # An encoder-decoder's decoder: the longest target it takes (the start token and every new token but the last
    # are fed to it); None: not known.
    target_max_length: int | None = None
    # An encoder-decoder's decoder's vocabulary (its logits' width), which a decoder prompt's ids must be below;
    # None: not known, or a decoder-only model (which takes no decoder prompt).
    target_vocab: int | None = None
    encoder_decoder: bool = False
    # An encoder that takes features (Whisper's input_features): each item's must be of its sizes, float.
    features: TensorSpec | None = None

    def _features_problem(self, prompt: Prompt, max_new_tokens: int, is_features: bool) -> str | None:
        """An item for an encoder of features: float, of the sizes it takes (the one validator's check)."""
        from mha_deploy.runtime.validation import fixed_shape_problem

        if self.features is None:
            return (f"{prompt.label}: float features {prompt.input_ids.shape}, but this model's encoder takes token "
                    "ids [seq]")
        if not is_features:
            return (f"{prompt.label}: token ids, but this model's encoder takes {self.features.name} features "
                    f"{list(self.features.axes[1:])} (float)")
        problem = fixed_shape_problem(self.features, prompt.input_ids.shape)
        if problem is not None:
            return f"{prompt.label}: {problem.message}"
        if not np.isfinite(prompt.input_ids).all():
            return f"{prompt.label}: {self.features.name} contains NaN or Inf"
        return self._decoder_prompt_problem(prompt, max_new_tokens)

    def _decoder_prompt_problem(self, prompt: Prompt, max_new_tokens: int) -> str | None:
        """What is wrong with an item's decoder prompt, or with the target it and the new tokens make."""
        given = prompt.decoder_prompt
        if given is not None and not self.encoder_decoder:
            return (f"{prompt.label}: \"decoder_prompt\" is an encoder-decoder's; this model is decoder-only (put "
                    "the ids in its prompt)")
        given = given if given is not None else np.zeros(0, np.int64)
        bad = given[(given < 0) | (given >= self.target_vocab)] if self.target_vocab is not None else given[given < 0]
        if bad.size:
            allowed = f"0 to {self.target_vocab - 1}" if self.target_vocab is not None else "non-negative"
            return f"{prompt.label}: decoder_prompt token id {int(bad[0])} is past the decoder's vocabulary ({allowed})"
        # Fed to the decoder: the start id, the rest of its prompt and every new token but the last.
        fed = max(len(given), 1) + max_new_tokens - 1
        if self.target_max_length is not None and fed > self.target_max_length:
            return (f"{prompt.label}: the decoder takes at most {self.target_max_length} target tokens (its recorded "
                    f"max length), fewer than its decoder prompt and --max-new-tokens {max_new_tokens} need; lower it")
        return None

    def problem(self, prompt: Prompt, max_new_tokens: int) -> str | None:
        if prompt.problem is not None:
            return prompt.problem
        is_features = prompt.input_ids.dtype.kind == "f"
        if self.features is not None or is_features:
            return self._features_problem(prompt, max_new_tokens, is_features)
        ids = prompt.input_ids
        if ids.size == 0:
            return f"{prompt.label}: is empty; give at least one token"
        bad = ids[(ids < 0) | (ids >= self.vocab)] if self.vocab is not None else ids[ids < 0]
        if bad.size:
            allowed = f"0 to {self.vocab - 1}" if self.vocab is not None else "non-negative"
            return (f"{prompt.label}: token id {int(bad[0])} is past the model's vocabulary ({allowed}); was it "
                    "tokenized for another model?")
        if (problem := self._decoder_prompt_problem(prompt, max_new_tokens)) is not None:
            return problem
        if self.max_length is None:
            return None
        if self.with_new_tokens and ids.size + max_new_tokens > self.max_length:
            return (f"{prompt.label}: {ids.size} tokens + {max_new_tokens} new ones exceed {self.length_from} "
                    f"{self.max_length}; shorten it or lower --max-new-tokens")
        if not self.with_new_tokens and ids.size > self.max_length:
            return f"{prompt.label}: {ids.size} tokens exceed {self.length_from} {self.max_length}; shorten it"
        return None


def pads_exactly(stepper) -> bool:
    """Whether a ``KVCacheStepper``'s prompts of different lengths can share a batch and still give each the tokens it
    gets alone. A decoder-only file: by the rule ``serve`` mixes lengths by (``mixes_lengths_exactly``: a ragged
    cache, or holes with ``position_ids`` or positions measured as none; not a module's own positions over the
    cache, which see the padding). An encoder takes its source padded on the right, so its ``attention_mask``
    suffices; the decoder's rows all start from the start id."""
    encoder = getattr(stepper, "encoder", None)
    if encoder is not None:
        return "attention_mask" in encoder.inputs
    return mixes_lengths_exactly(stepper)


def prompt_limits(stepper, max_length: int | None = None) -> PromptLimits:
    """The limits a ``KVCacheStepper``'s files set: a decoder-only model's vocabulary is its logits' last axis, an
    encoder-decoder's source vocabulary the rows of the tables its encoder's ``input_ids`` index; the longest
    sequence is ``max_length`` when given, else what the (encoder's) file records (``export --max-length``)."""
    encoder = getattr(stepper, "encoder", None)
    graph = stepper.graph if encoder is None else encoder
    if (features := getattr(stepper, "source_features", None)) is not None:
        pair = getattr(stepper.graph, "pair", None)
        return PromptLimits(with_new_tokens=False, target_max_length=pair.max_length if pair is not None else None,
                            target_vocab=vocab_size(stepper), encoder_decoder=True, features=features)
    recorded = getattr(getattr(graph.session, "metadata", None), "max_length", None)
    if recorded is None and getattr(graph, "pair", None) is not None:  # export --kv-cache's encoder-decoder pair
        recorded = graph.pair.max_length
    length = {"max_length": max_length, "length_from": "--max-length"} if max_length is not None else (
        {"max_length": recorded, "length_from": "the file's max_length"})
    if encoder is None:
        return PromptLimits(graph.vocab_size, **length)
    from mha_deploy.runtime.session_file import read_graph
    from mha_deploy.token_tables import vocabulary

    # An encoder given as a session (not a file) leaves the vocabulary unknown: ORT then names the bad id itself.
    # The table's rows are its shape: the graph without the weights' bytes says them.
    path = Path(encoder.source)
    source = vocabulary(read_graph(path), "input_ids") if path.is_file() else None
    pair = getattr(stepper.graph, "pair", None)  # export --kv-cache's decoder records the module's max length
    target = pair.max_length if pair is not None else None
    return PromptLimits(source, with_new_tokens=False, target_max_length=target, target_vocab=vocab_size(stepper),
                        encoder_decoder=True, **length)


class PromptGenerator:
    """Generates for a stream of prompts through one ``TokenStepper``, batch by batch (see the module's doc).

    ``options`` are the batch runner's (``RunnerOptions``): rows and cache positions per batch, the window
    sorted by length, and what a bad prompt does ("stop": ``InputError`` naming it; "skip": left out and
    listed in ``RunStats.errors``).
    """

    def __init__(
        self,
        stepper: TokenStepper,
        config: GenerationConfig,
        options: RunnerOptions | None = None,
        *,
        limits: PromptLimits | None = None,
        tokenizer: PromptTokenizer | None = None,
        provider: str = "cpu",
        pad_prompts: bool = True,
    ):
        # Here rather than at the first batch, so that an end id the model cannot produce stops the run before any
        # output is begun.
        config.check_vocabulary(vocab_size(stepper))
        self.stepper, self.config = stepper, config
        self.pad_prompts = pad_prompts  # prompts of different lengths share batches (see ``pads_exactly``)
        self.options = options or RunnerOptions()
        self.limits = limits or PromptLimits()
        self.tokenizer = tokenizer
        self.provider = provider

    def run_stream(
        self, prompts: Iterable[Prompt], stats: RunStats, on_batch: BatchCallback | None = None, source: str = ""
    ) -> Iterator[list[tuple[Prompt, np.ndarray]]]:
        """Per window of prompts, (prompt, new tokens) in input order; ``on_batch(prompts, new tokens)``."""
        window: list[Prompt] = []
        batches = 0  # batches run so far in this stream: batch b samples with seed + b
        seen: set[str] = set()  # ids so far, as JSON: two output lines of one id could not be told apart
        for prompt in prompts:
            problem = self.limits.problem(prompt, self.config.max_new_tokens)
            key = json.dumps(prompt.id, sort_keys=True)
            if problem is None and key in seen:
                problem = f"{prompt.label}: appears twice in this shard; give each prompt its own id"
            seen.add(key)
            if problem:
                error = ItemError(source, str(prompt.id), problem)
                if self.options.on_error == "stop":
                    raise InputError(str(error))
                stats.errors.append(error)
                continue
            window.append(prompt)
            if len(window) >= self.options.window_items:
                results, batches = self._run_window(window, stats, on_batch, batches)
                yield results
                window = []
        if window:
            yield self._run_window(window, stats, on_batch, batches)[0]

    def _plan(self, window: list[Prompt]) -> list[list[int]]:
        # The planner counts an item's length on its arrays: a view as long as the prompt and its new tokens,
        # the cache positions its row may take, bounds the batch's cache with max_batch_tokens.
        new = self.config.max_new_tokens
        # An encoder's features fill no cache position: the decoder's prompt and new tokens do.
        features = self.limits.features is not None
        items = [{"input_ids": np.broadcast_to(np.int64(0), (_length(p, features) + new,))} for p in window]
        limits = BatchLimits(self.options.batch_size, self.options.max_batch_tokens)
        signature = PADDED_PROMPTS if self.pad_prompts else EQUAL_PROMPTS
        return plan_batches(items, signature, limits, sort=self.options.bucket_window > 0)

    def _run_window(
        self, window: list[Prompt], stats: RunStats, on_batch: BatchCallback | None, first_batch: int
    ) -> tuple[list[tuple[Prompt, np.ndarray]], int]:
        """The window's (prompt, new tokens) in input order, and the number of the next batch."""
        results: list[np.ndarray | None] = [None] * len(window)
        number = first_batch
        for number, indices in enumerate(self._plan(window), first_batch):
            config = self.config
            if config.seed is not None:
                config = replace(config, seed=offset_seed(config.seed, number))
            t0 = time.perf_counter()
            prompts = [window[i].decoder_prompt for i in indices]
            output = generate(self.stepper, *self._prompt_batch([window[i].input_ids for i in indices]),
                              config=config, decoder_prompts=prompts if any(p is not None for p in prompts) else None)
            stats.batch_ms.append((time.perf_counter() - t0) * 1e3)
            new_tokens = sum(len(tokens) for tokens in output.tokens)
            for index, tokens in zip(indices, output.tokens, strict=True):
                results[index] = tokens
            stats.items += len(indices)
            stats.tokens += new_tokens
            stats.padded_tokens += new_tokens
            if on_batch:
                on_batch(len(indices), new_tokens)
        return list(zip(window, results, strict=True)), number + 1

    def _prompt_batch(self, prompts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
        """(ids, mask) [rows, longest]: an encoder's source padded on the right (where every position source of an
        encoder still counts from its first real token), a decoder's prompts on the left (its next token is then
        every row's last column); an encoder's features stacked, no mask."""
        if self.limits.features is not None:
            return np.stack(prompts), None
        ids, mask = prompt_batch(prompts)  # left-padded
        if getattr(self.stepper, "decoder_start_token_id", None) is not None:
            for row, prompt in enumerate(prompts):
                ids[row], mask[row] = np.roll(ids[row], len(prompt)), np.roll(mask[row], len(prompt))
        return ids, mask

    def line(self, prompt: Prompt, tokens: np.ndarray) -> str:
        """One output line: ``{"id", "output_ids"[, "text"]}``."""
        record = {"id": prompt.id, "output_ids": [int(t) for t in tokens]}
        if self.tokenizer is not None:
            record["text"] = self.tokenizer.decode(tokens)
        return json.dumps(record, ensure_ascii=False) + "\n"


def _length(prompt: Prompt, features: bool) -> int:
    """The cache positions a prompt takes before its new tokens: its ids, or with features its decoder prompt."""
    if features:
        return len(prompt.decoder_prompt) if prompt.decoder_prompt is not None else 1
    return prompt.input_ids.size


def run_prompt_shard(generator: PromptGenerator, shard: Shard, on_batch: BatchCallback | None = None) -> RunStats:
    """One shard's prompts into its JSONL output, written beside it and renamed into place when complete."""
    stats = RunStats(provider=generator.provider)
    start = time.perf_counter()
    for stale in stale_temporaries(shard.output):
        stale.unlink(missing_ok=True)
    try:
        with atomic_path(shard.output) as tmp, tmp.open("w", encoding="utf-8") as out:
            prompts = read_prompts(shard.path, generator.tokenizer)
            for window in generator.run_stream(prompts, stats, on_batch, source=shard.name):
                out.writelines(generator.line(prompt, tokens) for prompt, tokens in window)
    except MHADeployError:
        raise
    except OSError as exc:
        raise OutputError(f"{shard.output}: cannot write it ({exc.strerror or exc})") from exc
    stats.seconds = time.perf_counter() - start
    stats.shards_written = 1
    return stats


def generation_job(
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    model: str | os.PathLike,
    generator: PromptGenerator,
    *,
    encoder: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> DatasetJob:
    """The ``DatasetJob`` of a generation: its shards, and as settings everything besides the model that makes
    the outputs (the search, the limits, the encoder's and tokenizer's bytes), so a rerun that differs is refused."""
    settings = {
        "generation": asdict(generator.config),
        "limits": asdict(generator.limits),
        "pad_prompts": generator.pad_prompts,
        "encoder": sha256_digest(encoder) if encoder is not None else None,
        "tokenizer": sha256_digest(generator.tokenizer.path) if generator.tokenizer is not None else None,
    }
    shards = list_prompt_shards(Path(input_path), Path(output_path))
    return DatasetJob(input_path, output_path, model, overwrite=overwrite, options=generator.options,
                      shards=shards, settings=json.loads(json.dumps(settings)))


def run_generation(
    job: DatasetJob,
    generator: PromptGenerator,
    on_start: Callable[[int], None] | None = None,
    on_batch: BatchCallback | None = None,
) -> RunStats:
    """Every shard of ``job`` not done yet through ``generator``; ``on_start(total prompts)`` before the first."""
    return run_shards(
        job, generator.options, generator.provider, lambda todo: sum(count_prompts(s.path) for s in todo),
        lambda shard: run_prompt_shard(generator, shard, on_batch), on_start,
    )


@dataclass(frozen=True)
class GenerationShards:
    """``generate``'s task for Ray actors (``batch.ray_engine.ShardTask``): the driver's ``PromptGenerator`` as files
    and settings, with what the driver resolved (end ids recorded in the file, limits, padding, the encoder found
    beside its decoder), so that each actor rebuilds that generator once and runs a shard as the local engine does
    (``run_prompt_shard``). Batch ``b`` of a shard then samples with ``offset_seed(seed, b)`` whichever actor runs
    it, counted from the shard's start as locally: outputs are the local engine's, byte for byte."""

    model: str
    config: GenerationConfig
    options: RunnerOptions
    limits: PromptLimits
    pad_prompts: bool
    encoder: str | None = None
    start_id: int | None = None
    tokenizer: str | None = None
    provider: str = "cpu"

    @classmethod
    def of(cls, generator: PromptGenerator, provider: str = "cpu") -> GenerationShards:
        """The task of ``generator``, whose stepper is a ``KVCacheStepper`` opened from files (an actor opens them
        again at the same paths: they must be on every node)."""
        stepper = generator.stepper
        decoder, encoder = getattr(stepper, "graph", None), getattr(stepper, "encoder", None)
        sources = [getattr(graph, "source", None) for graph in (decoder, encoder) if graph is not None]
        paths = [Path(source) for source in sources if source is not None and Path(source).is_file()]
        if decoder is None or len(paths) < len(sources):
            raise InputError("--engine ray opens the model in each actor from its files, and this generator's model "
                             "is not read from a file; give a KVCacheStepper opened from the model's path")
        return cls(
            str(paths[0].resolve()), generator.config, generator.options, generator.limits, generator.pad_prompts,
            encoder=str(paths[1].resolve()) if len(paths) > 1 else None,
            start_id=getattr(stepper, "decoder_start_token_id", None),
            tokenizer=str(generator.tokenizer.path.resolve()) if generator.tokenizer is not None else None,
            provider=provider,
        )

    def load(self, threads: int) -> Callable[[Shard], RunStats]:
        from mha_deploy.runtime.kv_stepper import KVCacheStepper

        stepper = KVCacheStepper(self.model, encoder=self.encoder, decoder_start_token_id=self.start_id,
                                 threads=threads, provider=self.provider)
        generator = PromptGenerator(
            stepper, self.config, self.options, limits=self.limits, pad_prompts=self.pad_prompts,
            tokenizer=PromptTokenizer(self.tokenizer) if self.tokenizer is not None else None,
        )
        return functools.partial(run_prompt_shard, generator)


def run_generation_on_ray(
    job: DatasetJob,
    task: GenerationShards,
    threads: int | None = None,
    ray: RayOptions | None = None,
    on_start: Callable[[int], None] | None = None,
    on_batch: BatchCallback | None = None,
) -> RunStats:
    """``run_generation`` with the shards spread over Ray actors, each running ``task`` (``ray_engine``); the
    driver counts the prompts, keeps the manifest and records each shard an actor reports done."""
    job.options = task.options
    return run_shards_on_ray(job, task, lambda todo: sum(count_prompts(s.path) for s in todo), threads, ray,
                             on_start, on_batch)
