"""``genai_config.json`` for a decoder-only KV-cache export, so that onnxruntime-genai generates from the file as
it is (``export --kv-cache --genai``, ``mha-deploy genai-config``). No torch.

onnxruntime-genai runs any decoder whose inputs and outputs its config names (``model.type`` "decoder"); it
feeds ``input_ids``, ``attention_mask`` int64 over the cached and new tokens (1 = real), ``position_ids`` when
the file takes them, and ``past_key_values.{i}.key|value`` [batch, heads, past, head_dim] (past 0 on the prompt),
and reads ``logits`` and ``present.{i}.key|value`` = past ++ new: the interface ``own_kv_cache`` exports. What
the config must hold besides the names (onnxruntime-genai 0.18, tried): ``context_length`` (> 0; the search's
``max_length`` at most it), ``vocab_size`` (the logits' width), and ``past_present_share_buffer``: true for a
file in the ragged layout (metadata ``cache_layout``; its GroupQueryAttention writes each step's keys and values
into the buffer it reads, which onnxruntime-genai 0.18 then allocates once at ``max_length`` on the CPU too: its
greedy tokens equal ours, tests/runtime/test_genai.py), false for the holes layout (the file grows its cache by a
Concat, present is a new tensor each call). It pads a batch's prompts on the
right with ``pad_token_id`` and finds each prompt's end by it, so a prompt whose last real token equals the pad
id loses it: record a pad id no prompt ends with.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from mha_deploy.atomic import atomic_path
from mha_deploy.errors import ModelFileError
from mha_deploy.metadata import CACHE_RAGGED, ModelMetadata
from mha_deploy.runtime.kv_stepper import CROSS_CACHE, DECODER_INPUTS, SELF_CACHE

GENAI_CONFIG = "genai_config.json"
# The file's names as onnxruntime-genai's config spells them: %d is the attention's index.
PAST_KEY, PAST_VALUE = "past_key_values.%d.key", "past_key_values.%d.value"
PRESENT_KEY, PRESENT_VALUE = "present.%d.key", "present.%d.value"
# The inputs onnxruntime-genai can feed a decoder, under their config keys (the same names in the file).
_GENAI_INPUTS = ("input_ids", "attention_mask", "position_ids")


def genai_config(metadata: ModelMetadata, filename: str, max_length: int | None = None,
                 source: str = "model", threads: int | None = None) -> dict:
    """The config onnxruntime-genai reads for the decoder ``filename`` whose ``metadata`` is given; ``max_length``
    (the longest sequence, prompt and new tokens) defaults to the recorded one; ``threads``: ONNX Runtime's
    intra-op threads (None: its default, one per core). A ``ModelFileError`` saying what is missing when the file
    is not a decoder-only KV-cache model in Optimum's names."""
    signature = metadata.signature
    inputs = {spec.name: spec for spec in signature.inputs}
    outputs = {spec.name: spec for spec in signature.outputs}
    if not signature.kv_cache or signature.model != "custom" or "input_ids" not in inputs:
        raise ModelFileError(
            f"{source}: onnxruntime-genai runs a causal LM's KV-cache file (export --module ... --kv-cache), "
            f"not this one (inputs {', '.join(inputs)})"
        )
    cross = [name for name in inputs if CROSS_CACHE.match(name)]
    caches = sorted((name for name in inputs if SELF_CACHE.match(name)), key=_cache_order)
    unknown = [name for name in inputs if name not in _GENAI_INPUTS and name not in caches and name not in cross]
    if cross or unknown or any(name in DECODER_INPUTS - set(_GENAI_INPUTS) for name in inputs):
        raise ModelFileError(
            f"{source}: onnxruntime-genai's decoder config takes a decoder-only model; this one also takes "
            f"{', '.join(cross + unknown)}"
        )
    layers = len(caches) // 2
    if caches != sorted((f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")),
                        key=_cache_order) or "logits" not in outputs:
        raise ModelFileError(f"{source}: its caches are not past_key_values.0..{layers - 1}.key|value with logits out")
    vocab = outputs["logits"].axes[-1]
    _, heads, _, head_dim = inputs[caches[0]].axes
    context = max_length if max_length is not None else metadata.max_length
    if context is None:
        raise ModelFileError(
            f"{source}: no max length recorded, and onnxruntime-genai needs the longest sequence the model takes "
            "(context_length): export with --max-length N, or give --max-length here"
        )
    if not all(isinstance(size, int) for size in (vocab, heads, head_dim)):
        raise ModelFileError(f"{source}: the logits' vocabulary or the caches' heads are not fixed sizes in the file")
    ids = metadata.generation
    model = {"type": "decoder", "context_length": context, "vocab_size": vocab}
    if ids is not None:
        if ids.eos_token_ids:
            model["eos_token_id"] = ids.eos_token_ids[0] if len(ids.eos_token_ids) == 1 else ids.eos_token_ids
        if ids.pad_token_id is not None:
            model["pad_token_id"] = ids.pad_token_id
        # A start id given at export (--start-id) is the one asked for; else the model's own bos, from its config.
        bos = ids.decoder_start_token_id if ids.decoder_start_token_id is not None else ids.bos_token_id
        if bos is not None:
            model["bos_token_id"] = bos
    session_options = {"log_id": "mha-deploy", "provider_options": []}
    if threads is not None:
        session_options["intra_op_num_threads"] = threads
    model["decoder"] = {
        "filename": filename,
        "session_options": session_options,
        # A grouped-query model's cache holds its KV heads, fewer than the queries' (metadata.num_heads).
        "hidden_size": max(metadata.num_heads, heads) * head_dim,
        "head_size": head_dim,
        "num_attention_heads": max(metadata.num_heads, heads),
        "num_key_value_heads": heads,
        "num_hidden_layers": layers,
        "inputs": {**{name: name for name in _GENAI_INPUTS if name in inputs},
                   "past_key_names": PAST_KEY, "past_value_names": PAST_VALUE},
        "outputs": {"logits": "logits", "present_key_names": PRESENT_KEY, "present_value_names": PRESENT_VALUE},
    }
    # transformers' generate defaults: greedy, one beam; the search runs to context_length unless told less.
    search = {
        "do_sample": False, "num_beams": 1, "num_return_sequences": 1, "max_length": context, "min_length": 0,
        "temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0, "length_penalty": 1.0,
        "early_stopping": True, "no_repeat_ngram_size": 0, "diversity_penalty": 0.0,
        "past_present_share_buffer": metadata.cache_layout == CACHE_RAGGED,
    }
    return {"model": model, "search": search}


def write_genai_config(
    model_path: str | os.PathLike, max_length: int | None = None, threads: int | None = None
) -> tuple[Path, list[str]]:
    """Write ``genai_config.json`` beside the decoder at ``model_path`` (atomically: the old file or the whole new
    one, nothing when it fails); returns its path and warnings about what onnxruntime-genai will do with it."""
    model_path = Path(model_path)
    from mha_deploy.runtime.session import check_model_file  # the checks every session makes on load

    metadata = check_model_file(model_path)
    config = genai_config(metadata, model_path.name, max_length, str(model_path), threads)
    warnings = []
    if "pad_token_id" not in config["model"]:
        warnings.append(
            "no pad id recorded (export --pad-id): onnxruntime-genai then pads prompts of different lengths with "
            "its default and takes a prompt's trailing ids equal to it for padding"
        )
    path = model_path.parent / GENAI_CONFIG
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(config, indent=2) + "\n")
    return path, warnings


def _cache_order(name: str) -> tuple[int, str]:
    match = SELF_CACHE.match(name)
    return int(match.group(1)), match.group(2)
