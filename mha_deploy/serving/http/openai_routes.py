"""OpenAI-compatible routes of a generator: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``.

What OpenAI's API reference names, as its clients send them: ``model``, ``prompt`` (text, a list of texts, a list of
token ids, or a list of such lists), ``max_tokens`` (completions default 16; chat: ``max_completion_tokens`` too),
``temperature`` (default 1: sampling; 0 is greedy), ``top_p`` (in (0, 1]: 0 would keep no token), ``seed`` (64
bits), ``n``, ``stop`` (up to 4 strings; token ids are taken in it too, and in ``stop_token_ids``), ``stream``
(server-sent events ending ``data: [DONE]``; ``stream_options.include_usage`` adds a last chunk with the usage),
``usage``. Log probabilities, under the model's raw distribution (before temperature, penalties or bias), of the
chosen token and the likeliest alternatives, from one place in the engine in two shapes, each token as OpenAI shows
it (``token_texts``): completions' ``logprobs`` (0 to 5 alternatives, OpenAI's limit there: ``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``) and chat's ``logprobs: true`` with
``top_logprobs`` (0 to 20, OpenAI's limit there: ``choices[i].logprobs.content``, one ``{token, logprob, bytes,
top_logprobs}`` per token), streamed too. ``echo`` (completions): each choice's text starts with its prompt (sent
first when streamed); with ``logprobs``, the prompt's tokens are scored too (from the prefill's logits at every
position; the first token has none), not on an encoder-decoder, whose prompt is a source no logits score.
``presence_penalty`` and ``frequency_penalty`` (in [-2, 2]: a token's logit loses ``frequency_penalty`` per time
this choice generated it and ``presence_penalty`` once it has; the prompt does not count), ``logit_bias`` (an object
of token-id strings to biases in [-100, 100], added to the logits; ids checked against the vocabulary), all per
request, also when requests share the batch. Beyond OpenAI: ``top_k`` and ``repetition_penalty`` (as vLLM takes
them), and ``token_ids`` in each choice (the generated ids; a server without a tokenizer returns no text, only them).
Refused with a 400 naming the field: ``suffix``, ``best_of`` other than ``n``.

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 ``invalid_request_error`` for a
bad request, 404 for an unknown model or a chat without a template, 429 with ``Retry-After`` when the queue is full,
503 while loading or draining.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mha_deploy.runtime.logits import MAX_LOGIT_BIAS, MAX_PENALTY
from mha_deploy.seeds import SEED_LIMIT
from mha_deploy.serving.http.body import read_json
from mha_deploy.serving.http.generation import (
    Choice,
    EventStream,
    GenerationService,
    Sampling,
    until_done_or_gone,
)
from mha_deploy.serving.http.parsing import FieldError, RequestError
from mha_deploy.serving.http.prompt_ids import prompt_list, token_id
from mha_deploy.serving.http.seq2seq_fields import (
    check_forced_bos,
    decoder_prompts,
    features_prompts,
    forced_bos_token_id,
)
from mha_deploy.serving.http.token_texts import TextCursor

logger = logging.getLogger("mha_deploy.serve")
MAX_LOGPROBS = 5  # completions: OpenAI's own limit for the legacy route (the engine's cost does not grow with it)
MAX_TOP_LOGPROBS = 20  # chat: OpenAI's limit
LOWEST_LOGPROB = -9999.0  # OpenAI's stand-in for a token too unlikely to score (and JSON has no -Infinity)
MAX_STOP = 4
MAX_STOP_IDS = 64  # an id costs one comparison per step: a bound, not OpenAI's (it takes strings only)
MAX_LOGIT_BIAS_IDS = 300  # each id costs a scatter per step: a bound on what one request may bias
UNSUPPORTED = {"suffix": None}
ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 408: "invalid_request_error",
               413: "invalid_request_error", 401: "authentication_error", 429: "rate_limit_error",
               503: "server_unavailable", 500: "server_error"}


class OpenAIError(FieldError):
    """A ``RequestError`` that names the request field at fault (OpenAI's ``param``)."""


def error_body(status: int, code: str, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def error_response(exc: RequestError) -> Response:
    headers = dict(exc.headers)
    if exc.status == 429:
        headers["Retry-After"] = "1"
    return JSONResponse(error_body(exc.status, exc.kind, exc.message, getattr(exc, "param", None)),
                        status_code=exc.status, headers=headers)


def _bad(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, code, f"{param}: {message}", param)


def _number(body: dict, name: str, default, low: float, high: float, low_open: bool = False, hint: str = ""):
    """A number in [low, high] (``low_open``: (low, high]); ``hint`` follows the refusal."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high or (
            low_open and value == low):
        raise _bad(name, f"must be a number in {'(' if low_open else '['}{low:g}, {high:g}], got {value!r}{hint}")
    return value


def _integer(body: dict, name: str, default, low: int, high: int | None = None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise _bad(name, f"must be an integer {bound}, got {value!r}")
    return value


def parse_sampling(
    body: dict, service: GenerationService, max_tokens_names=("max_tokens",)
) -> tuple[Sampling, tuple[str, ...]]:
    """The settings every generation route shares, checked; a 400 names the first field at fault."""
    for name, neutral in UNSUPPORTED.items():
        if body.get(name, neutral) not in (neutral, None):
            raise _bad(name, f"is not supported by this server (only {neutral!r})", "unsupported_parameter")
    max_tokens = service.settings.default_max_tokens
    for name in max_tokens_names:
        if body.get(name) is not None:
            max_tokens = _integer(body, name, None, 1)
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str | int) else stop
    if not isinstance(stops, list):
        raise _bad("stop", f"must be a string or a list of at most {MAX_STOP} strings (or token ids), got {stop!r}")
    strings = tuple(s for s in stops if isinstance(s, str) and s)
    ids = [s for s in stops if isinstance(s, int) and not isinstance(s, bool)]
    if len(strings) + len(ids) != len([s for s in stops if s != ""]) or len(strings) > MAX_STOP:
        raise _bad("stop", f"must be a string or a list of at most {MAX_STOP} strings (or token ids), got {stop!r}")
    if len(ids) > MAX_STOP_IDS:
        raise _bad("stop", f"at most {MAX_STOP_IDS} token ids")
    extra = body.get("stop_token_ids") or []
    if not isinstance(extra, list) or len(extra) > MAX_STOP_IDS or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in extra):
        raise _bad("stop_token_ids", f"must be a list of at most {MAX_STOP_IDS} token ids")
    vocab = service.vocabulary
    stop_ids = tuple([token_id(i, "stop", vocab) for i in ids] + [token_id(i, "stop_token_ids", vocab) for i in extra])
    if strings and service.tokenizer is None:
        raise _bad("stop", "stop strings need a tokenizer (start the server with --tokenizer); give token ids")
    top_k = _integer(body, "top_k", None, -1)
    forced = forced_bos_token_id(body)
    check_forced_bos(forced, service)
    sampling = Sampling(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        # 0 would keep no token: refused, as generate --top-p refuses it (greedy decoding is temperature 0)
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True,
                      hint=" (no token has 0 of the probability mass; for greedy decoding send temperature 0)"),
        top_k=None if top_k in (None, -1, 0) else top_k,
        seed=_integer(body, "seed", None, 0, SEED_LIMIT - 1),
        stop_ids=stop_ids,
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.01, 100.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        logit_bias=_logit_bias(body.get("logit_bias"), vocab),
        forced_bos_token_id=forced,
    )
    return sampling, strings


def _logit_bias(value, vocab: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: a JSON object whose keys are token ids (as strings, JSON's only keys) and whose values
    are biases in [-100, 100]; as (id, bias) pairs."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise _bad("logit_bias", f"must be an object mapping token ids (strings) to biases in "
                                 f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value!r}")
    if len(value) > MAX_LOGIT_BIAS_IDS:
        raise _bad("logit_bias", f"at most {MAX_LOGIT_BIAS_IDS} token ids, got {len(value)}")
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise _bad("logit_bias", f"keys must be token ids written in decimal digits, got {key!r}")
        token = int(key)
        if any(token == seen for seen, _ in pairs):
            raise _bad("logit_bias", f"token id {token} is given twice ({key!r})")
        token_id(token, "logit_bias", vocab)
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise _bad("logit_bias", f"the bias of token {token} must be a number in "
                                     f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}")
        pairs.append((token, float(bias)))
    return tuple(pairs)


async def _prompts(value, service: GenerationService) -> list[tuple[np.ndarray, str | None]]:
    """``prompt`` as OpenAI takes it: a string, a list of strings, a list of token ids, or a list of such lists; each as
    (ids, its text as given, None for ids)."""
    return await field_ids(value, "prompt", service.encode, service.ids)


async def field_ids(value, param: str, encode, ids) -> list[tuple[np.ndarray, str | None]]:
    """``prompt_ids.prompt_list`` of one request field (``prompt``, embeddings' ``input``), its refusals naming the
    field as OpenAI's ``param``."""
    try:
        return await prompt_list(value, param, encode, ids)
    except RequestError as exc:
        raise OpenAIError(exc.status, exc.kind, exc.message, param) from None


def check_model(body: object, model_name: str) -> None:
    """A 400 unless ``body`` is a JSON object naming a model, a 404 unless it is ``model_name``."""
    if not isinstance(body, dict):
        raise _bad("body", "must be a JSON object")
    name = body.get("model")
    if not isinstance(name, str):
        raise _bad("model", "is required (a string): this server serves " + repr(model_name))
    if name != model_name:
        raise OpenAIError(404, "model_not_found",
                          f"the model {name!r} does not exist: this server serves {model_name!r}", "model")


def _finite(logprob: float | None) -> float | None:
    return None if logprob is None else max(logprob, LOWEST_LOGPROB)


def _completion_logprobs(entries, service: GenerationService, cursor: TextCursor) -> dict:
    """Completions' shape of scored tokens (the engine's ``TokenLogprob`` or ``TokenEvent``), each token as the text
    it decodes to (``token_texts``); ``cursor`` walks the sequence the entries continue, for ``text_offset``."""
    show = service.token_texts.show
    tokens = [show(e.token) for e in entries]
    top = [None if e.top_logprobs is None else {show(t): _finite(lp) for t, lp in e.top_logprobs.items()}
           for e in entries]
    return {"tokens": tokens, "token_logprobs": [_finite(e.logprob) for e in entries],
            "top_logprobs": top if any(t is not None for t in top) else None,
            "text_offset": [cursor.offset(e.token) for e in entries]}


def _chat_logprobs(entries, service: GenerationService) -> dict:
    """Chat's shape of the same: ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``,
    each token as completions show it, ``bytes`` the UTF-8 bytes it adds to the text (part of a character's, for a
    token that holds part of one)."""
    texts = service.token_texts

    def token(token_id: int, logprob: float) -> dict:
        return {"token": texts.show(token_id), "logprob": _finite(logprob), "bytes": list(texts.token_bytes(token_id))}

    return {"content": [{**token(e.token, e.logprob), "top_logprobs": [
        token(t, lp) for t, lp in (e.top_logprobs or {}).items()]} for e in entries], "refusal": None}


def _chat_logprob_settings(body: dict) -> int | None:
    """Chat's ``logprobs`` (a boolean) and ``top_logprobs`` (0 to 20, only with ``logprobs``) as the engine's count
    of alternatives (None: no log probabilities)."""
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise _bad("logprobs", f"must be true or false on chat completions (top_logprobs says how many alternatives), "
                               f"got {wanted!r}")
    top = _integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise _bad("top_logprobs", "needs logprobs set to true")
    return (top or 0) if wanted else None


def openai_routes(service: GenerationService) -> list[Route]:
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": service.model_name, "object": "model", "created": service.created, "owned_by": "mha-deploy"}]})

    def start(prompts, body: dict, sampling: Sampling, stops, logprobs, echo: bool = False,
              decoders: list[np.ndarray | None] | None = None) -> list[Choice]:
        n = _integer(body, "n", 1, 1)
        if n * len(prompts) > service.settings.max_choices:
            raise _bad("n", f"{n} choices for {len(prompts)} prompts exceed this server's limit of "
                       f"{service.settings.max_choices} sequences per request")
        if body.get("best_of") not in (None, n):
            raise _bad("best_of", "is supported only equal to n", "unsupported_parameter")
        engine = service.require_ready()
        scored = echo and logprobs is not None
        if scored and engine.stepper.encoder is not None:
            raise _bad("echo", "echo with logprobs scores the prompt's tokens, which an encoder-decoder cannot: its "
                               "prompt is the encoder's source, scored by no logits; drop logprobs or echo",
                       "unsupported_parameter")
        settings = service.settings  # completed at load (recorded eos ids, the file's max_length)
        choices = []
        configs = [sampling.config(settings, j) for j in range(n)]
        try:
            for p, (prompt, text) in enumerate(prompts):
                param = "prompt" if len(prompts) == 1 else f"prompt[{p}]"
                if prompt.dtype.kind == "f":  # an encoder's features, checked when read (seq2seq_fields)
                    service.check_target(sampling.max_tokens, "input_features")
                else:
                    prompt = service.check_prompt(prompt, sampling.max_tokens, param)
                for j in range(n):
                    choice = Choice(p * n + j, prompt, service, stops)
                    if echo:
                        choice.echo = text if text is not None else service.decode(prompt.tolist())
                    choice.submit(engine, configs[j], logprobs, scored, decoders[p] if decoders else None)
                    choices.append(choice)
                    service.metrics.prompt_tokens.inc(choice.prompt_tokens)
        except BaseException:
            for choice in choices:
                choice.cancel()
            raise
        return choices

    def usage(choices: list[Choice]) -> dict:
        prompt = sum(c.prompt_tokens for c in choices)
        completion = sum(len(c.tokens) for c in choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def completions(request: Request) -> Response:
        return await _handle(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await _handle(request, chat=True)

    async def _handle(request: Request, chat: bool) -> Response:
        with service.track("openai_chat" if chat else "openai_completions"):
            try:
                body = await read_json(request, service.limits)
                check_model(body, service.model_name)
                echo = False
                if chat:
                    if body.get("input_features") is not None:
                        raise _bad("input_features", "features are a source for /v1/completions, not chat messages",
                                   "unsupported_parameter")
                    prompts = [(await _chat_prompt(body, service), None)]
                    logprobs = _chat_logprob_settings(body)
                    sampling, stops = parse_sampling(body, service, ("max_tokens", "max_completion_tokens"))
                else:
                    sampling, stops = parse_sampling(body, service)
                    logprobs = _integer(body, "logprobs", None, 0, MAX_LOGPROBS)
                    echo = body.get("echo", False)
                    if echo is not None and not isinstance(echo, bool):
                        raise _bad("echo", f"must be true or false, got {echo!r}")
                    features = features_prompts(body, service)
                    if features is not None and echo:
                        raise _bad("echo", "echoes a text or token prompt: input_features have none",
                                   "unsupported_parameter")
                    prompts = ([(item, None) for item in features] if features is not None
                               else await _prompts(body.get("prompt"), service))
                decoders = decoder_prompts(body, service, sampling.max_tokens, len(prompts))
                stream = body.get("stream", False)
                if not isinstance(stream, bool):
                    raise _bad("stream", "must be true or false")
                options = body.get("stream_options") or {}
                include_usage = isinstance(options, dict) and options.get("include_usage") is True
                choices = start(prompts, body, sampling, stops, logprobs, bool(echo), decoders)
            except RequestError as exc:
                service.metrics.errors.labels(exc.kind).inc()
                service.metrics.responses.labels(str(exc.status)).inc()
                return error_response(exc)
            except Exception:
                logger.exception("generation request failed")
                service.metrics.errors.labels("internal").inc()
                return error_response(RequestError(500, "internal_error", "internal error (the server log has it)"))
            ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            created = int(time.time())
            service.metrics.responses.labels("200").inc()
            if stream:
                chunks = _stream(choices, chat, ident, created, include_usage, usage)
                return EventStream(chunks, choices, lambda: None)
            finished = await until_done_or_gone(choices, request.receive)
            if not finished:
                return Response(status_code=499)  # nobody reads it: the client went away
            failed = next((c for c in choices if c.error), None)
            if failed is not None:
                return error_response(RequestError(500, "engine_error", failed.error))
            return JSONResponse({
                "id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": service.model_name, "choices": [_final_choice(c, chat) for c in choices],
                "usage": usage(choices)})

    def _final_choice(choice: Choice, chat: bool) -> dict:
        if chat:
            logprobs = _chat_logprobs(choice.logprobs, service) if choice.logprobs else None
            return {"index": choice.index, "message": {"role": "assistant", "content": choice.text},
                    "finish_reason": choice.finish_reason, "logprobs": logprobs, "token_ids": choice.tokens}
        logprobs = None
        if choice.logprobs:
            texts = service.token_texts
            logprobs = _completion_logprobs(choice.logprobs, service, texts.cursor(len(choice.echo)))
            if choice.prompt_logprobs is not None:
                prompt = _completion_logprobs(choice.prompt_logprobs, service, texts.cursor())
                logprobs = {key: _joined(prompt[key], logprobs[key], len(choice.prompt_logprobs))
                            for key in logprobs}
        return {"index": choice.index, "text": choice.echo + choice.text, "logprobs": logprobs,
                "finish_reason": choice.finish_reason, "token_ids": choice.tokens}

    async def _stream(choices, chat, ident, created, include_usage, usage):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(payload_choices, **extra) -> bytes:
            payload = {"id": ident, "object": kind, "created": created, "model": service.model_name,
                       "choices": payload_choices, **extra}
            return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

        if chat:
            yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                         for c in choices])
        reported = {c.index: 0 for c in choices}  # log probabilities already sent, per choice
        cursors = {c.index: service.token_texts.cursor(len(c.echo)) for c in choices}  # completions' text_offset
        echoed = {c.index: not c.echo for c in choices}
        pending = {asyncio.ensure_future(c.next_delta()): c for c in choices}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    choice = pending.pop(task)
                    delta = task.result()
                    if choice.error:
                        yield b"data: " + json.dumps(error_body(500, "engine_error", choice.error)).encode() + b"\n\n"
                        continue
                    new_tokens = choice.tokens[-1:]
                    new_logprobs = choice.logprobs[reported[choice.index]:]
                    reported[choice.index] = len(choice.logprobs)
                    if not echoed[choice.index]:  # the prompt first, as OpenAI streams an echo
                        echoed[choice.index] = True
                        scored = choice.prompt_logprobs
                        yield chunk([{"index": choice.index, "text": choice.echo, "finish_reason": None,
                                      "logprobs": None if scored is None else _completion_logprobs(
                                          scored, service, service.token_texts.cursor()),
                                      "token_ids": []}])
                    if chat:
                        body = {"index": choice.index, "delta": {"content": delta} if delta or not choice.done else {},
                                "logprobs": _chat_logprobs(new_logprobs, service) if new_logprobs else None,
                                "finish_reason": choice.finish_reason, "token_ids": new_tokens}
                    else:
                        logprobs = None
                        if new_logprobs:
                            logprobs = _completion_logprobs(new_logprobs, service, cursors[choice.index])
                        body = {"index": choice.index, "text": delta, "logprobs": logprobs,
                                "finish_reason": choice.finish_reason, "token_ids": new_tokens}
                    yield chunk([body])
                    if not choice.done:
                        pending[asyncio.ensure_future(choice.next_delta())] = choice
            if include_usage:
                yield chunk([], usage=usage(choices))
            yield b"data: [DONE]\n\n"
        finally:
            for task in pending:
                task.cancel()

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]


def _joined(prompt: list | None, generated: list | None, prompt_tokens: int) -> list | None:
    """One completions logprobs field over the prompt's tokens then the generated ones. Both sides ask the same
    number of alternatives, so ``top_logprobs`` is None on the generated side only when none were asked; the prompt's
    is None also when its one token is unscored."""
    if generated is None:
        return None
    return (prompt if prompt is not None else [None] * prompt_tokens) + generated


async def _chat_prompt(body: dict, service: GenerationService) -> np.ndarray:
    """The messages rendered by the server's chat template, then tokenized."""
    if service.chat_template is None:
        raise OpenAIError(404, "chat_template_missing",
                          "this server has no chat template (tokenizer.json carries none): start it with "
                          "--chat-template FILE (a jinja2 template over messages), or use /v1/completions",
                          "messages")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise _bad("messages", "must be a non-empty list of {\"role\": str, \"content\": str}")
    from jinja2 import TemplateError

    try:
        text = service.chat_template.render(messages=messages, add_generation_prompt=True)
    except TemplateError as exc:
        raise _bad("messages", f"the chat template refused them: {exc}") from None
    try:
        return await service.encode(text, "messages")
    except RequestError as exc:
        raise OpenAIError(exc.status, exc.kind, exc.message, "messages") from None
