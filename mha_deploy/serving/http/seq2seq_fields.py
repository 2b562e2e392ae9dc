"""What an encoder-decoder's generation request adds to its prompt, read alike by every generation route (OpenAI's
completions and chat, Triton's generate), each refused with a 400 that names the field:

- ``decoder_prompt``: token ids the decoder starts from (Whisper's ``<|startoftranscript|><|lang|><|task|>
  <|notimestamps|>``; M2M100's start id then a target language), the start id put in front where missing: what
  ``mha-deploy generate`` takes per JSONL item under the same name. The new tokens follow it; it is not returned.
  A request of several prompts (completions' list of prompts, features' items) may give a list of them instead,
  one per prompt in order; one list of ids applies to every prompt.
- ``forced_bos_token_id``: the first generated token, forced (M2M100's and MBart-50's target language id), for a
  request whose decoder starts from the start id alone; absent: the one recorded at export (the folder's generation
  config), if any, as ``generate --forced-bos-id`` defaults to it. A longer ``decoder_prompt`` is not forced.
- ``input_features``: the source as the encoder's features, for an encoder that takes them (Whisper's
  ``input_features`` [mel, frames]) instead of token ids: an object ``{"shape": [...], "data": "<base64>"}`` whose
  data is the little-endian buffer of ``dtype`` (``"float32"``, the default, or ``"float16"``), or nested JSON lists
  of numbers; one item [mel, frames] or a batch [items, mel, frames] (each item a prompt of its own, as a list of
  prompts is). Checked by the one validator (``runtime.kv_stepper.check_features``: the sizes the file records,
  float, finite), as ``generate`` and ``infer`` check them.

Every value is per request, so requests with different ones share the engine's batch: each row keeps its own
decoder tokens and logits processors (``serving.engine``).
"""

from __future__ import annotations

import base64
import binascii
import math

import numpy as np

from mha_deploy.errors import InputError
from mha_deploy.runtime.kv_stepper import check_features
from mha_deploy.serving.http.parsing import FieldError
from mha_deploy.serving.http.prompt_ids import token_id

FEATURE_DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2")}
EMPTY_PROMPTS = (None, "", [])  # what a request with input_features may send as prompt (the openai client's None)


def _bad(param: str, message: str, code: str = "invalid_value") -> FieldError:
    return FieldError(400, code, f"{param}: {message}", param)


def _encoder_decoder(service, param: str):
    """The ready engine of an encoder-decoder, or a 400 naming ``param`` (a 503 while loading)."""
    engine = service.require_ready()
    if engine.stepper.encoder is None:
        raise _bad(param, "is an encoder-decoder's (its decoder's start): this model is decoder-only, its decoder "
                          "starts from the prompt itself", "unsupported_parameter")
    return engine


def forced_bos_token_id(body: dict) -> int | None:
    """``forced_bos_token_id`` when given (checked against the model by ``check_forced_bos``)."""
    value = body.get("forced_bos_token_id")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise _bad("forced_bos_token_id", f"must be a token id (an integer), got {value!r}")
    return value


def check_forced_bos(value: int | None, service) -> None:
    if value is None:
        return
    _encoder_decoder(service, "forced_bos_token_id")
    token_id(value, "forced_bos_token_id", service.vocabulary)


def decoder_prompts(body: dict, service, max_tokens: int, prompts: int = 1) -> list[np.ndarray | None]:
    """``decoder_prompt`` for each of the request's ``prompts`` prompts, as int64 ids (the start id put in front by
    the engine where missing): one list of ids for every prompt, or a list of ``prompts`` such lists, one each (a
    completions request's list of prompts, or of feature items); Nones when the request gives none. A 400 naming
    the field unless the model is an encoder-decoder, the counts match, every id is in its vocabulary and the
    decoder's recorded max length holds each prompt and ``max_tokens`` new tokens."""
    value = body.get("decoder_prompt")
    if value is None:
        return [None] * prompts
    if not isinstance(value, list):
        raise _bad("decoder_prompt", f"must be a list of token ids (integers), or a list of such lists (one per "
                                     f"prompt), got {value!r}")
    engine = _encoder_decoder(service, "decoder_prompt")
    lists = [isinstance(item, list) for item in value]
    if not any(lists):
        return [_decoder_ids(value, "decoder_prompt", engine, service, max_tokens)] * prompts
    if not all(lists):
        raise _bad("decoder_prompt", "must be a list of token ids, or a list of such lists (one per prompt), not a "
                                     "mix of ids and lists")
    if len(value) != prompts:
        raise _bad("decoder_prompt", f"{_count(len(value), 'decoder prompt')} for {_count(prompts, 'prompt')}: give "
                                     "one list of token ids for every prompt, or one list per prompt")
    return [_decoder_ids(item, f"decoder_prompt[{i}]", engine, service, max_tokens) for i, item in enumerate(value)]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def _decoder_ids(value: list, param: str, engine, service, max_tokens: int) -> np.ndarray:
    ids = [token_id(token, param, service.vocabulary) for token in value]
    start = engine.stepper.decoder_start_token_id
    fed = len(ids) + (0 if ids[:1] == [start] else 1) - 1 + max_tokens  # the decoder's positions: prompt, new tokens
    target = engine.limits.target_max_length
    if target is not None and fed > target:
        raise FieldError(400, "context_length_exceeded",
                         f"{param}: its {len(ids)} ids (the start id {start} in front) and max_tokens "
                         f"{max_tokens} need {fed} decoder positions, past this encoder-decoder's recorded max "
                         f"length {target}; shorten it or lower max_tokens", param)
    longest = service.longest_prompt
    if longest is not None and len(ids) > longest:
        raise _bad(param, f"{len(ids)} ids, longer than this server takes ({longest})", "context_length_exceeded")
    return np.asarray(ids, np.int64)


def features_prompts(body: dict, service, prompt_field: str = "prompt") -> list[np.ndarray] | None:
    """The request's sources as the encoder's features items (``input_features``), or None when the request sends
    none and the model takes token ids (its prompt is read as usual); a 400 naming the field otherwise."""
    value = body.get("input_features")
    engine = service.engine
    spec = getattr(engine.stepper, "source_features", None) if engine is not None else None
    if value is None:
        if spec is not None:
            raise _bad("input_features", f"this model's encoder takes {spec.name} features "
                                         f"{list(spec.axes[1:])} (float), not a text or token prompt: send them in "
                                         "input_features (with OpenAI's client: extra_body)", "missing_parameter")
        return None
    engine = service.require_ready()
    if spec is None:
        what = "token ids (give prompt)" if engine.stepper.encoder is not None else (
            "a prompt: this model is decoder-only")
        raise _bad("input_features", f"this model takes {what}, not features", "unsupported_parameter")
    if body.get(prompt_field) not in EMPTY_PROMPTS:
        raise _bad(prompt_field, "give the source once: input_features or a prompt, not both (leave prompt null)")
    array = _features_array(value, len(spec.axes) - 1)
    try:
        array = check_features(spec, array)  # the one validator: the file's sizes, float, finite
    except InputError as exc:
        raise _bad("input_features", str(exc)) from None
    return list(array)


def _features_array(value, item_rank: int) -> np.ndarray:
    """``input_features`` as an array [items, <item axes>]: base64 with its shape, or nested lists of numbers."""
    if isinstance(value, dict):
        unknown = set(value) - {"shape", "data", "dtype"}
        if unknown:
            raise _bad("input_features", f"takes shape, data and dtype, not {sorted(unknown)}")
        dtype_name = value.get("dtype", "float32")
        if dtype_name not in FEATURE_DTYPES:
            raise _bad("input_features", f"dtype must be one of {sorted(FEATURE_DTYPES)}, got {dtype_name!r}")
        shape, data = value.get("shape"), value.get("data")
        if not isinstance(shape, list) or not shape or not all(
                isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in shape):
            raise _bad("input_features", f"shape must be a list of positive integers, got {shape!r}")
        if not isinstance(data, str):
            raise _bad("input_features", "data must be a base64 string of the features' little-endian bytes")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise _bad("input_features", "data is not valid base64") from None
        dtype = FEATURE_DTYPES[dtype_name]
        if len(raw) != math.prod(shape) * dtype.itemsize:
            raise _bad("input_features", f"data holds {len(raw)} bytes, shape {shape} of {dtype_name} needs "
                                         f"{math.prod(shape) * dtype.itemsize}")
        array = np.frombuffer(raw, dtype).reshape(shape)
    elif isinstance(value, list):
        try:
            array = np.asarray(value)
        except ValueError:  # lists of different lengths
            array = np.asarray([], object)
        if array.dtype.kind not in "iuf" or array.size == 0:
            raise _bad("input_features", "nested lists must hold numbers, every list of one axis the same length")
    else:
        raise _bad("input_features", 'must be {"shape": [...], "data": "<base64>"} or nested lists of numbers, got '
                                     f"{type(value).__name__}")
    if array.ndim == item_rank:
        array = array[None]  # one item
    if array.ndim != item_rank + 1:
        raise _bad("input_features", f"shape {list(array.shape)}: give one item of {item_rank} axes or a batch of "
                                     f"items ({item_rank + 1} axes)")
    return array
