"""Triton's generate extension (provisional in Triton): ``POST /v2/models/{name}[/versions/1]/generate`` and
``/generate_stream``.

Triton's request is one JSON object whose top-level fields are the model's inputs and whose ``parameters`` object
holds the rest; the response is ``{"model_name", "model_version", "text_output"}`` (``generate_stream``: one such
object per server-sent event, each with the text since the last). Here the inputs are ``text_input`` (text, needs
``--tokenizer``) or ``input_ids`` (token ids), and the settings are taken from ``parameters`` or the top level, in the
names Triton's LLM backends use: ``max_tokens``, ``temperature`` (0 or absent: greedy, as those backends default),
``top_p``, ``top_k``, ``seed`` (or ``random_seed``), ``stop`` / ``stop_words`` (strings), ``end_id`` /
``stop_token_ids``, ``repetition_penalty``, and OpenAI's ``presence_penalty``, ``frequency_penalty`` and ``logit_bias``
(checked as the OpenAI routes check them: the same parser). An encoder-decoder takes ``decoder_prompt`` and
``forced_bos_token_id``, and an encoder of features (Whisper) ``input_features`` instead of ``text_input`` /
``input_ids`` (one item; the fields and formats of ``seq2seq_fields``). Each response also carries ``output_ids`` and,
at the end, ``finish_reason``. Errors are the v2 protocol's ``{"error": "..."}`` (the stream's: an ``error`` event).
"""

from __future__ import annotations

import json
import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mha_deploy.serving.http import v2
from mha_deploy.serving.http.body import read_json
from mha_deploy.serving.http.generation import Choice, EventStream, GenerationService, until_done_or_gone
from mha_deploy.serving.http.openai_routes import parse_sampling
from mha_deploy.serving.http.parsing import RequestError
from mha_deploy.serving.http.seq2seq_fields import decoder_prompts, features_prompts

logger = logging.getLogger("mha_deploy.serve")
# Triton's LLM backends' names for OpenAI's, read from the top level or from parameters.
ALIASES = {"random_seed": "seed", "stop_words": "stop", "end_id": "stop_token_ids", "max_new_tokens": "max_tokens"}


def triton_generate_routes(service: GenerationService) -> list[Route]:
    async def generate(request: Request) -> Response:
        return await _handle(request, stream=False)

    async def generate_stream(request: Request) -> Response:
        return await _handle(request, stream=True)

    async def _handle(request: Request, stream: bool) -> Response:
        with service.track("triton_generate_stream" if stream else "triton_generate"):
            try:
                _check_model(request)
                body = await read_json(request, service.limits)
                if not isinstance(body, dict):
                    raise RequestError(400, "bad_request", "the body must be a JSON object")
                choice = await _start(body)
            except RequestError as exc:
                service.metrics.errors.labels(exc.kind).inc()
                service.metrics.responses.labels(str(exc.status)).inc()
                return JSONResponse({"error": exc.message}, status_code=exc.status,
                                    headers={**exc.headers, **({"Retry-After": "1"} if exc.status == 429 else {})})
            except Exception:  # the v2 protocol's shape, not starlette's plain-text 500; the log has the rest
                logger.exception("generate request failed")
                service.metrics.errors.labels("internal").inc()
                service.metrics.responses.labels("500").inc()
                return JSONResponse({"error": "internal error (the server log has it)"}, status_code=500)
            service.metrics.responses.labels("200").inc()
            if stream:
                return EventStream(_events(choice), [choice], lambda: None)
            if not await until_done_or_gone([choice], request.receive):
                return Response(status_code=499)
            if choice.error:
                return JSONResponse({"error": choice.error}, status_code=500)
            return JSONResponse(_response(choice, choice.text, choice.tokens, final=True))

    def _check_model(request: Request) -> None:
        service.check_model(request.path_params["name"], request.path_params.get("version", ""))

    async def _start(body: dict) -> Choice:
        parameters = body.get("parameters") or {}
        if not isinstance(parameters, dict):
            raise RequestError(400, "bad_request", "parameters must be a JSON object")
        merged = {ALIASES.get(k, k): v for k, v in {**body, **parameters}.items()}
        if merged.get("temperature") is None:  # absent or null: this route's default, greedy
            merged["temperature"] = 0.0
        if "stop_token_ids" in merged and isinstance(merged["stop_token_ids"], int):
            merged["stop_token_ids"] = [merged["stop_token_ids"]]
        if merged.get("stream") not in (None, False, True):
            raise RequestError(400, "bad_request", "stream must be true or false")
        sampling, stops = parse_sampling(merged, service)
        text, ids = body.get("text_input"), body.get("input_ids")
        features = features_prompts(merged, service, "text_input" if text is not None else "input_ids")
        (decoder,) = decoder_prompts(merged, service, sampling.max_tokens)  # one prompt per request here
        if features is not None:
            if len(features) != 1:
                raise RequestError(400, "bad_request", f"input_features: one item per request, got {len(features)}")
            engine = service.require_ready()
            service.check_target(sampling.max_tokens, "input_features")
            choice = Choice(0, features[0], service, stops)
            choice.submit(engine, sampling.config(service.settings), None, decoder_prompt=decoder)
            return choice
        if (text is None) == (ids is None):
            raise RequestError(400, "bad_request", "give text_input (a string) or input_ids (token ids), one of them")
        if text is not None:
            if isinstance(text, list) and len(text) == 1:  # a batch of one, as a BYTES tensor of shape [1]
                text = text[0]
            if not isinstance(text, str):
                raise RequestError(400, "bad_request", "text_input must be a string")
            prompt = await service.encode(text, "text_input")
        else:
            prompt = await service.ids(ids, "input_ids")
        engine = service.require_ready()
        prompt = service.check_prompt(prompt, sampling.max_tokens, "text_input" if text is not None else "input_ids")
        choice = Choice(0, prompt, service, stops)
        choice.submit(engine, sampling.config(service.settings), None, decoder_prompt=decoder)
        service.metrics.prompt_tokens.inc(len(prompt))
        return choice

    def _response(choice: Choice, text: str, ids: list[int], final: bool) -> dict:
        body = {"model_name": service.model_name, "model_version": v2.MODEL_VERSION, "text_output": text,
                "output_ids": ids}
        if final:
            body["finish_reason"] = choice.finish_reason
        return body

    async def _events(choice: Choice):
        while not choice.done:
            before = len(choice.tokens)
            delta = await choice.next_delta()
            if choice.error:
                yield b"data: " + json.dumps({"error": choice.error}).encode() + b"\n\n"
                return
            payload = _response(choice, delta, choice.tokens[before:], final=choice.done)
            yield b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    return [
        Route(path + suffix, endpoint, methods=["POST"])
        for path in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}")
        for suffix, endpoint in (("/generate", generate), ("/generate_stream", generate_stream))
    ]
