"""What the generation routes share: the engine's lifetime, prompts and settings checked once, text out of tokens.

- ``GenerationSettings``: the server's limits for generation (longest output, prompt + output, choices per request).
- ``GenerationService``: loads the model into a ``serving.engine.GenerationEngine`` (in a thread, at startup),
  with a status (loading -> ready -> draining, or failed), the Prometheus metrics and the tokenizer / chat template.
- ``Sampling``: one request's settings as every protocol (OpenAI's, Triton's) states them, checked and turned into
  the engine's ``GenerationConfig``.
- ``Choice``: one running sequence seen from the event loop: its tokens and text so far (the text decoded from all
  tokens each time, so a character split across tokens comes out whole), stop strings (the text ends before the
  first; the sequence is cancelled there), and the events it hears from the engine's thread.
- ``EventStream``: a server-sent events response that cancels its sequences as soon as the client goes away.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

import numpy as np

from mha_deploy.errors import InputError, OptionError
from mha_deploy.runtime.generation import GenerationConfig
from mha_deploy.seeds import offset_seed
from mha_deploy.serving.engine import (
    EngineBusy,
    GenerationEngine,
    GenerationRequest,
    RequestTooLarge,
    TokenEvent,
    TokenLogprob,
)
from mha_deploy.serving.http.metrics import GenerationMetrics
from mha_deploy.serving.http.parsing import RequestError, RequestLimits
from mha_deploy.serving.http.prompt_ids import list_ids, text_ids, token_id
from mha_deploy.serving.http.service import TrackedService
from mha_deploy.serving.http.text_bound import chars_per_token
from mha_deploy.serving.http.token_texts import TokenTexts

logger = logging.getLogger("mha_deploy.serve")
REPLACEMENT = "\ufffd"  # what a tokenizer decodes half a multi-byte character to


@dataclass(frozen=True)
class GenerationSettings:
    """The server's limits on what one generation request may ask for."""

    # The most tokens one request may generate (max_tokens beyond it: 400).
    max_new_tokens: int = 1024
    # Prompt + max_tokens at most this (the model's position table); None: no limit but the KV budget.
    max_length: int | None = None
    # The most choices one request may ask for (n, times the prompts of a list).
    max_choices: int = 16
    # Ids that end every sequence (the tokenizer's end of text), besides each request's own stop ids.
    eos_token_ids: tuple[int, ...] = ()
    # Token ids default for completions when max_tokens is not given (OpenAI's default is 16).
    default_max_tokens: int = 16


class GenerationService(TrackedService):
    """The engine of one served generator, its readiness and its counters (shared by every generation route)."""

    def __init__(
        self,
        load_engine: Callable[[GenerationMetrics], GenerationEngine],
        settings: GenerationSettings,
        limits: RequestLimits,
        model_name: str,
        on_load_error: Callable[[BaseException], None] | None = None,
        tokenizer=None,
        chat_template: str | None = None,
    ):
        self._load_engine = load_engine
        self.settings = settings
        self.limits = limits
        self.model_name = model_name
        self._on_load_error = on_load_error
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        # Read once: the most characters one token stands for (None: no bound), and how tokens show in logprobs.
        self.chars_per_token = chars_per_token(tokenizer.tokenizer) if tokenizer is not None else None
        self.token_texts = TokenTexts(tokenizer.tokenizer if tokenizer is not None else None)
        self.metrics = GenerationMetrics()
        self.status = "loading"
        self.engine: GenerationEngine | None = None
        self.accepted = 0
        self.answered = 0
        self.created = int(time.time())

    async def load(self) -> None:
        try:
            engine = await asyncio.to_thread(self._load_engine, self.metrics)
            engine.start()
        except Exception as exc:
            self.status = "failed"
            logger.error("cannot load the model: %s", exc)
            if self._on_load_error is not None:
                self._on_load_error(exc)
            return
        self.engine = engine
        recorded = engine.stepper.generation_ids
        if not self.settings.eos_token_ids and recorded is not None and recorded.eos_token_ids:
            # the ids recorded at export (export --eos-id), as mha-deploy generate defaults to them
            self.settings = replace(self.settings, eos_token_ids=tuple(recorded.eos_token_ids))
        if self.settings.max_length is None:  # what the file records (export --max-length), if anything
            self.settings = replace(self.settings, max_length=engine.limits.max_length)
        if self.status != "loading":
            return
        self.status = "ready"
        self.metrics.ready.set(1)
        self.metrics.kv_budget.set(engine.budget.max_kv_tokens)
        ends = ", ".join(map(str, self.settings.eos_token_ids)) or "none (each request runs to max_tokens or a stop)"
        logger.info("ready: generator %r, %s; KV budget %d positions, %d requests at once; eos ids %s",
                    self.model_name, engine.batching, engine.budget.max_kv_tokens, engine.max_running, ends)

    async def drain(self, timeout: float | None = None) -> None:
        if self.status == "ready":
            self.status = "draining"
        self.metrics.ready.set(0)
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop, timeout)

    def require_ready(self) -> GenerationEngine:
        if self.status != "ready":
            raise RequestError(503, "not_ready", f"the server is {self.status}")
        return self.engine  # type: ignore[return-value]

    # --- prompts -----------------------------------------------------------------------------------

    @property
    def longest_prompt(self) -> int | None:
        """The most tokens a prompt can hold: the model's maximum length, else what the KV budget holds."""
        if self.settings.max_length is not None:
            return self.settings.max_length
        return self.engine.budget.max_kv_tokens if self.engine is not None else None

    async def encode(self, text: str, param: str) -> np.ndarray:
        """A text prompt's token ids (``prompt_ids.text_ids``: refused by its length when too long to fit)."""
        return await text_ids(text, param, self.tokenizer, self.longest_prompt, self.chars_per_token)

    async def ids(self, items: object, param: str) -> np.ndarray:
        """A prompt given as token ids (a JSON list of integers), as int64 (``prompt_ids.list_ids``)."""
        return await list_ids(items, param, self.longest_prompt, self._bad_id)

    @property
    def vocabulary(self) -> int | None:
        """How many ids the model generates from (its logits' last axis; a decoder prompt's, stop ids' and a forced
        id's bound); None while it loads or where the file leaves it open."""
        return self.engine.stepper.graph.vocab_size if self.engine is not None else None

    def _bad_id(self, token: int, param: str) -> None:
        """Refuse a prompt's ``token``, outside the ids a prompt may hold (an encoder-decoder's: its encoder's)."""
        vocab = self.engine.limits.vocab if self.engine is not None else None
        token_id(token, param, vocab, ": was the prompt tokenized for another model?" if vocab is not None else "")

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(np.asarray(ids, np.int64)) if self.tokenizer is not None else ""

    def check_target(self, max_new_tokens: int, param: str) -> None:
        """A 400 when an encoder-decoder's decoder cannot take ``max_new_tokens`` (its recorded max length)."""
        target = self.engine.limits.target_max_length if self.engine is not None else None
        if target is not None and max_new_tokens > target:  # export --kv-cache's decoder: its position table
            raise RequestError(400, "context_length_exceeded",
                               f"{param}: max_tokens {max_new_tokens} is more target tokens than this "
                               f"encoder-decoder's decoder takes ({target}, its recorded max length); lower max_tokens")

    def check_prompt(self, ids: np.ndarray, max_new_tokens: int, param: str) -> np.ndarray:
        ids = np.asarray(ids, np.int64)
        if ids.size == 0:
            raise RequestError(400, "empty_prompt", f"{param}: the prompt is empty (no token)")
        vocab = self.engine.limits.vocab if self.engine is not None else None
        outside = (ids < 0) | (ids >= vocab) if vocab is not None else ids < 0
        if outside.any():
            self._bad_id(int(ids[outside.argmax()]), param)
        self.check_target(max_new_tokens, param)
        limit = self.settings.max_length
        source = self.engine is not None and not self.engine.limits.with_new_tokens  # an encoder's source
        if limit is not None and source and ids.size > limit:
            raise RequestError(400, "context_length_exceeded",
                               f"{param}: the source's {ids.size} tokens exceed this model's maximum length {limit}")
        if limit is not None and not source and ids.size + max_new_tokens > limit:
            raise RequestError(400, "context_length_exceeded",
                               f"{param}: the prompt's {ids.size} tokens and max_tokens {max_new_tokens} exceed this "
                               f"model's maximum length {limit} (--max-length); shorten the prompt or lower max_tokens")
        return ids


@dataclass(frozen=True)
class Sampling:
    """One request's settings as the protocols state them (OpenAI's names); ``config`` checks them."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs: OpenAI's object, hashable
    forced_bos_token_id: int | None = None  # an encoder-decoder's forced first token (None: the recorded one)

    def config(self, settings: GenerationSettings, choice: int = 0) -> GenerationConfig:
        """The engine's config; choice ``i`` of a request with a seed samples with ``seed + i`` mod 2**64 (each choice
        its own draw, the request reproducible)."""
        if self.max_tokens > settings.max_new_tokens:
            raise RequestError(400, "max_tokens_too_large",
                               f"max_tokens {self.max_tokens} is past this server's limit of {settings.max_new_tokens}")
        try:
            return GenerationConfig(
                max_new_tokens=self.max_tokens, do_sample=self.temperature > 0,
                temperature=self.temperature if self.temperature > 0 else 1.0, top_p=self.top_p,
                top_k=self.top_k if self.temperature > 0 else None, repetition_penalty=self.repetition_penalty,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                logit_bias=dict(self.logit_bias) or None,
                eos_token_id=list(settings.eos_token_ids) or None, stop_token_ids=self.stop_ids,
                seed=None if self.seed is None else offset_seed(self.seed, choice),
                forced_bos_token_id=self.forced_bos_token_id,
            )
        except (InputError, OptionError) as exc:
            raise RequestError(400, "bad_sampling", str(exc)) from None


class Choice:
    """One sequence of a request, as the event loop follows it (see the module's doc)."""

    def __init__(self, index: int, prompt: np.ndarray, service: GenerationService, stop: tuple[str, ...] = ()):
        self.index = index
        self.prompt = prompt
        self.service = service
        self.stop = stop
        self.tokens: list[int] = []
        self.echo = ""  # what the answer's text starts with: the prompt, when a completion asks for echo
        self.logprobs: list[TokenEvent] = []
        self.prompt_logprobs: list[TokenLogprob] | None = None  # the prompt's tokens scored (echo with logprobs)
        self.text = ""  # the text so far, up to a stop string when one came
        self.sent = 0  # characters of text already streamed
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.ticket = None
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

    @property
    def prompt_tokens(self) -> int:
        """The prompt's tokens, as usage counts them: none for an encoder's features (no token)."""
        return 0 if self.prompt.dtype.kind == "f" else len(self.prompt)

    def submit(
        self, engine: GenerationEngine, config: GenerationConfig, logprobs: int | None, prompt_logprobs: bool = False,
        decoder_prompt: np.ndarray | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()

        def notify(event: TokenEvent) -> None:  # the engine's thread
            loop.call_soon_threadsafe(self.queue.put_nowait, event)

        try:
            self.ticket = engine.submit(
                GenerationRequest(self.prompt, config, logprobs, prompt_logprobs, decoder_prompt), notify)
        except RequestTooLarge as exc:
            raise RequestError(400, "context_length_exceeded", str(exc)) from None
        except EngineBusy as exc:
            raise RequestError(429, "overloaded", str(exc)) from None
        except InputError as exc:
            raise RequestError(400, "bad_prompt", str(exc)) from None

    def cancel(self) -> None:
        if self.ticket is not None and self.finish_reason is None:
            self.ticket.cancel()

    async def next_delta(self) -> str:
        """Wait for the next event; the new text it makes sendable (held back while a stop string may be starting
        or a character is half decoded)."""
        event = await self.queue.get()
        if event.error is not None:
            self.error, self.finish_reason = event.error, "error"
            return ""
        self.tokens.append(event.token)
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = list(event.prompt_logprobs)
        if event.logprob is not None:
            self.logprobs.append(event)
        self.finish_reason = event.finish_reason
        if self.service.tokenizer is not None:
            self._update_text()
        return self.pending()

    def _update_text(self) -> None:
        text = self.service.decode(self.tokens)
        for stop in self.stop:
            at = text.find(stop)
            if at >= 0:
                text = text[:at]
                self.finish_reason = "stop"
                self.ticket.cancel()  # its rows go at the engine's next turn
        self.text = text

    def pending(self) -> str:
        """Text not yet sent that can be sent now."""
        end = len(self.text)
        if self.finish_reason is None:
            if self.text.endswith(REPLACEMENT):
                end -= 1
            if self.stop:  # a stop string may be starting in the last characters: keep them until it is known
                end = max(self.sent, end - (max(map(len, self.stop)) - 1))
        delta = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return delta

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


async def run_choices(choices: list[Choice]) -> None:
    """Until every choice has finished (non-streamed requests)."""
    for choice in choices:
        while not choice.done:
            await choice.next_delta()


async def watch_disconnect(receive) -> None:
    """Returns when the client goes away (an ASGI http.disconnect after the body was read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_done_or_gone(choices: list[Choice], receive) -> bool:
    """Runs the choices to their end; False (every choice cancelled) if the client goes away first."""
    work = asyncio.ensure_future(run_choices(choices))
    gone = asyncio.ensure_future(watch_disconnect(receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            task.cancel()
        for choice in choices:
            choice.cancel()
    return work.done() and not work.cancelled() and work.exception() is None


class EventStream:
    """An ASGI server-sent events response over ``chunks`` (already ``data: ...\\n\\n`` encoded). Its choices are
    cancelled the moment the client disconnects, also between tokens, and whenever the stream ends otherwise."""

    def __init__(self, chunks: AsyncIterator[bytes], choices: list[Choice], on_end: Callable[[], None]):
        self.chunks = chunks
        self.choices = choices
        self.on_end = on_end

    async def __call__(self, scope, receive, send):
        gone = asyncio.ensure_future(watch_disconnect(receive))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]})
            iterator = self.chunks.__aiter__()
            while True:
                following = asyncio.ensure_future(iterator.__anext__())
                await asyncio.wait({following, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not following.done():  # the client left while the next token was coming
                    following.cancel()
                    break
                try:
                    chunk = following.result()
                except StopAsyncIteration:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except OSError:  # the client left while a chunk was being sent
            pass
        finally:
            gone.cancel()
            for choice in self.choices:
                choice.cancel()
            self.on_end()
