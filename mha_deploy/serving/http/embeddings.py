"""OpenAI's ``POST /v1/embeddings`` over an encoder whose output is one vector per item (a sentence-embedding model
that pools its token states: ``[batch, d]``), through the same micro-batcher as ``/v2/.../infer``.

A request: ``model`` (the served name), ``input`` (a string, a list of strings, a list of token ids, or a list of such
lists; texts need the server's tokenizer), ``encoding_format`` (``float``, the default, or ``base64``: each vector's
little-endian float32 bytes, as OpenAI's clients decode them), ``dimensions`` (accepted only equal to the model's: a
model not trained to nest its dimensions, Matryoshka-style, has no shorter vector to give), ``user`` (ignored).
The answer: ``{"object": "list", "data": [{"object": "embedding", "index": i, "embedding": ...}], "model",
"usage": {"prompt_tokens", "total_tokens"}}``, each vector scaled to unit length (L2) unless the server was started to
return the model's output as it is (``EmbeddingOptions.normalize``).

Every input is one item for the batcher: its ids go to the file's token input (segment ids, if the file takes them,
all 0: one text, no pair), padding is the batcher's, so a text's vector is the same alone or beside longer ones. The
ids are checked by the runtime's one validator (``item_problem``: the vocabulary, the longest item, the file's
maximum length) before anything runs; the body, queue, API keys and request slots are bounded as for any route.

Which output: the one ``EmbeddingOptions.output`` names (a wrong name stops the server's start), else
``sentence_embedding`` (sentence-transformers' name, which ``export --hf`` gives a sentence-transformers folder's
pooled vector), else the file's only float output of shape ``[batch, d]`` (BERT's ``pooler_output`` aside: no trained
embedding). A file with none, or with inputs beyond token ids (a float sequence, an image), answers 400 saying why.
Errors have OpenAI's shape (``openai_routes.error_response``), naming the field at fault.
"""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import dataclass

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mha_deploy.errors import MHADeployError
from mha_deploy.runtime.validation import item_problem
from mha_deploy.serving.http.body import read_json
from mha_deploy.serving.http.openai_routes import OpenAIError, check_model, error_body, error_response, field_ids
from mha_deploy.serving.http.parsing import RequestError
from mha_deploy.serving.http.prompt_ids import is_id_list, list_ids, text_ids
from mha_deploy.serving.http.server import EmbeddingOptions
from mha_deploy.serving.http.service import InferenceService
from mha_deploy.serving.http.text_bound import chars_per_token
from mha_deploy.signature import BATCH_AXIS, MODEL_DTYPE, PADDING_MASK, SEGMENTS, TOKENS, Signature

try:  # ~15x faster than tolist() + json.dumps for arrays of floats (part of the 'serve' extra)
    import orjson
except ImportError:  # pragma: no cover - depends on the environment
    orjson = None

logger = logging.getLogger("mha_deploy.serve")
PATH = "/v1/embeddings"
ENCODING_FORMATS = ("float", "base64")
NORM_EPS = 1e-12  # as torch.nn.functional.normalize (sentence-transformers' Normalize): a zero vector stays zero
# [batch, d] outputs that are no embedding, left out of the automatic choice (they can still be named): BERT's
# pooler_output is tanh(dense(first token)), the input of its next-sentence head, not a trained sentence embedding.
NOT_EMBEDDINGS = ("pooler_output",)
# A [batch, d] output of this name is the embedding whatever else the file returns: sentence-transformers' name for
# its pooled (and normalised) vector, which export --hf keeps.
EMBEDDING_OUTPUT = "sentence_embedding"


class EmbeddingSetupError(MHADeployError):
    """The output ``EmbeddingOptions.output`` names cannot be served as embeddings."""


@dataclass(frozen=True)
class EmbeddingModel:
    """What /v1/embeddings needs of the served file: where the ids go and which output holds the vectors."""

    tokens: str  # the token input an input's ids fill
    segments: tuple[str, ...]  # segment-id inputs, all 0
    output: str  # [batch, dimensions] floats
    dimensions: int


def embedding_model(signature: Signature, output: str | None = None) -> EmbeddingModel | str:
    """The file as an embedding model, or why it is none (a sentence that completes "cannot serve embeddings: ...")."""
    inputs = signature.custom_inputs if signature.model == "custom" else signature.inputs
    tokens = [spec.name for spec in inputs if spec.role == TOKENS]
    others = [spec for spec in inputs if spec.role not in (TOKENS, SEGMENTS, PADDING_MASK)]
    if len(tokens) != 1 or others:
        taken = ", ".join(f"{spec.name} ({spec.role})" for spec in inputs)
        return f"the model takes {taken}, where an embedding model takes one input of token ids (and its padding mask)"
    pooled = [spec for spec in signature.outputs if spec.dtype == MODEL_DTYPE and len(spec.axes) == 2
              and spec.axes[0] == BATCH_AXIS and isinstance(spec.axes[1], int)]
    described = ", ".join(f"{spec.name} {spec.describe()}" for spec in signature.outputs)
    if output is not None:
        chosen = [spec for spec in pooled if spec.name == output]
        if not chosen:
            return (f"its output {output!r} is not one vector per item ([batch, d] floats): the model returns "
                    f"{described}")
    else:
        chosen = [spec for spec in pooled if spec.name == EMBEDDING_OUTPUT] or [
            spec for spec in pooled if spec.name not in NOT_EMBEDDINGS]
        if not chosen:
            skipped = "".join(f"; {spec.name} is no trained embedding (name it with --embedding-output to serve it "
                              "anyway)" for spec in pooled)
            return (f"no output is an embedding (one vector per item, [batch, d] floats): the model returns "
                    f"{described} (export the model with its pooling, e.g. the mean of its token states over the "
                    f"attention mask){skipped}")
        if len(chosen) > 1:
            return (f"{len(chosen)} outputs are one vector per item ({', '.join(spec.name for spec in chosen)}): name "
                    "the one that holds the embeddings (serve --embedding-output)")
    segments = tuple(spec.name for spec in inputs if spec.role == SEGMENTS)
    return EmbeddingModel(tokens[0], segments, chosen[0].name, int(chosen[0].axes[1]))


def check_embedding_output(signature: Signature, options: EmbeddingOptions) -> None:
    """Raise ``EmbeddingSetupError`` when the output the options name cannot be served (a bad setting stops the
    start); log which output /v1/embeddings serves, or why it serves none."""
    found = embedding_model(signature, options.output)
    if isinstance(found, str):
        if options.output is not None:
            raise EmbeddingSetupError(f"--embedding-output {options.output}: cannot serve embeddings: {found}")
        logger.debug("no %s: %s", PATH, found)
        return
    logger.info("%s: output %s, %d dimensions, %s", PATH, found.output, found.dimensions,
                "normalised to unit length" if options.normalize else "as the model returns them")


def embedding_routes(service: InferenceService, options: EmbeddingOptions, tokenizer=None) -> list[Route]:
    """``POST /v1/embeddings`` over ``service``'s batcher; ``tokenizer``, a ``PromptTokenizer``, for texts."""
    limits = service.limits
    per_token = chars_per_token(tokenizer.tokenizer) if tokenizer is not None else None

    async def encode(text: str, param: str) -> np.ndarray:
        if not text:  # a tokenizer may still add its special tokens: an empty text is no input (as OpenAI's)
            raise RequestError(400, "empty_input", f"{param}: an empty string has nothing to embed")
        return await text_ids(text, param, tokenizer, limits.max_item_tokens, per_token)

    async def ids(items: list, param: str) -> np.ndarray:
        return await list_ids(items, param, limits.max_item_tokens, out_of_range)

    def out_of_range(token: int, param: str) -> None:
        raise RequestError(400, "id_out_of_range", f"{param}: token id {token} is past int64, and past any vocabulary")

    async def embeddings(request: Request) -> Response:
        with service.track("openai_embeddings"):
            try:
                response = await _embeddings(request)
            except RequestError as exc:
                service.metrics.errors.labels(exc.kind).inc()
                response = error_response(exc)
            except Exception:
                logger.exception("embeddings request failed")
                service.metrics.errors.labels("internal").inc()
                response = JSONResponse(error_body(500, "internal", "internal error (the server log has the "
                                                                   "details)"), status_code=500)
        service.metrics.responses.labels(str(response.status_code)).inc()
        return response

    async def _embeddings(request: Request) -> Response:
        session, batcher = service.require_ready()
        body = await read_json(request, limits)
        check_model(body, service.model_name)
        model = embedding_model(session.signature, options.output)
        if isinstance(model, str):
            raise OpenAIError(400, "not_an_embedding_model",
                              f"{service.model_name!r} cannot serve embeddings: {model}", "model")
        encoding = body.get("encoding_format", "float")
        if encoding is None:
            encoding = "float"
        if encoding not in ENCODING_FORMATS:
            raise _bad("encoding_format", f"must be 'float' or 'base64', got {encoding!r}")
        dimensions = body.get("dimensions")
        if dimensions is not None and (type(dimensions) is not int or dimensions != model.dimensions):
            raise _bad("dimensions", f"this model's embeddings have {model.dimensions} dimensions, and it was not "
                                     f"trained to give shorter ones; send {model.dimensions} or leave it out, got "
                                     f"{dimensions!r}", "unsupported_value")
        value = body.get("input")
        if isinstance(value, list) and not is_id_list(value) and len(value) > batcher.max_queue:
            raise _bad("input", f"{len(value)} inputs in one request; this server takes at most {batcher.max_queue}",
                       "too_many_inputs")
        arrays = [array for array, _ in await field_ids(value, "input", encode, ids)]
        items = [_item(model, array, session.metadata, limits.max_item_tokens, where)
                 for array, where in zip(arrays, _names(len(arrays)), strict=True)]
        results = await batcher.submit_many(items)
        vectors = np.stack([result[model.output] for result in results]).astype(np.float32, copy=False)
        if options.normalize:
            norms = np.linalg.norm(vectors.astype(np.float64), axis=1, keepdims=True)
            vectors = (vectors / np.maximum(norms, NORM_EPS)).astype(np.float32)
        tokens = sum(len(array) for array in arrays)
        content = _encode(vectors, encoding, service.model_name, tokens)
        return Response(content, media_type="application/json")

    return [Route(PATH, embeddings, methods=["POST"])]


def _names(count: int) -> list[str]:
    return ["input"] if count == 1 else [f"input[{i}]" for i in range(count)]


def _item(model: EmbeddingModel, ids: np.ndarray, metadata, max_item_tokens: int, where: str) -> dict:
    """One input as the batcher's item, checked by the runtime's validator (a 400 naming the input)."""
    item = {model.tokens: ids, **{name: np.zeros_like(ids) for name in model.segments}}
    problem = item_problem(metadata, item, max_item_tokens)
    if problem:
        raise OpenAIError(400, problem.kind, f"{where}: {problem.message}", "input")
    return item


def _encode(vectors: np.ndarray, encoding: str, model_name: str, tokens: int) -> bytes:
    """OpenAI's answer: float vectors as JSON numbers (each float32 with the shortest digits that read back as it),
    or base64 of their little-endian float32 bytes."""
    if encoding == "base64":
        data = [base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii") for vector in vectors]
    elif orjson is not None:
        data = list(vectors)
    else:
        data = vectors.tolist()
    payload = {"object": "list",
               "data": [{"object": "embedding", "index": i, "embedding": vector} for i, vector in enumerate(data)],
               "model": model_name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    if orjson is not None:
        return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)
    return json.dumps(payload, separators=(",", ":")).encode()


def _bad(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, code, f"{param}: {message}", param)


def generator_refusal(model_name: str) -> Route:
    """``POST /v1/embeddings`` on a generator's server: a 400 saying why it serves none."""
    async def refuse(request: Request) -> Response:
        return error_response(OpenAIError(
            400, "not_an_embedding_model", f"{model_name!r} is a generator (a KV-cache decoder): it returns tokens, "
            "not embeddings; serve an encoder whose output is one vector per item", "model"))

    return Route(PATH, refuse, methods=["POST"])
