"""Prometheus metrics of one server, in a registry of its own (two apps in one process do not collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Milliseconds to seconds: a tiny model answers in ~1 ms, a long sequence in ~1 s.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "mha_requests",
            "Inference requests received, by protocol and body format (v1: content type; v2_json, v2_binary, grpc).",
            ["format"],
            registry=r,
        )
        self.responses = Counter(
            "mha_responses", "Inference responses sent, by HTTP status (gRPC: code name).", ["status"], registry=r
        )
        self.errors = Counter(
            "mha_request_errors", "Refused or failed inference requests, by kind.", ["kind"], registry=r
        )
        self.latency = Histogram(
            "mha_request_latency_seconds",
            "Time from request start to response, in the server.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "mha_queue_wait_seconds", "Time an item waited for its batch to start.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.batch_run = Histogram(
            "mha_batch_run_seconds",
            "Time one batch spent in ONNX Runtime (with padding and splitting).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram("mha_batch_size", "Items per batch run.", buckets=BATCH_BUCKETS, registry=r)
        self.padding = Counter(
            "mha_padded_positions", "Query positions computed, real or padding.", ["kind"], registry=r
        )
        self.in_flight = Gauge("mha_requests_in_flight", "Inference requests being handled.", registry=r)
        self.queued = Gauge("mha_batcher_queue_items", "Items waiting for a batch.", registry=r)
        self.ready = Gauge("mha_ready", "1 once the model is loaded and warm, 0 while loading or draining.", registry=r)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# Seconds: a first token takes a prefill (milliseconds to seconds), a later token one decode step.
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class GenerationMetrics(ServerMetrics):
    """A generator's server: the request counters every server has, and what its decode loop reports
    (``serving.engine.GenerationObserver``'s hooks, called from the engine's thread)."""

    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.time_to_first_token = Histogram(
            "mha_generation_time_to_first_token_seconds", "From a request's arrival in the engine to its first token.",
            buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.time_per_output_token = Histogram(
            "mha_generation_time_per_output_token_seconds",
            "Per finished request: time from its first to its last token, over the tokens after the first.",
            buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.generated = Counter(
            "mha_generation_tokens", "Tokens generated (rate() of it is tokens/s).", registry=r)
        self.prompt_tokens = Counter("mha_generation_prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.running = Gauge("mha_generation_running_requests", "Requests prefilling or decoding.", registry=r)
        self.waiting = Gauge("mha_generation_waiting_requests", "Requests queued for the KV budget.", registry=r)
        self.cache_tokens = Gauge(
            "mha_generation_cache_tokens", "KV cache positions held now (rows x width, masked holes included).",
            registry=r)
        self.kv_budget = Gauge("mha_generation_kv_budget_tokens", "--max-kv-tokens: the positions planned at most.",
                               registry=r)

    # GenerationObserver
    def first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def finished(self, tokens: int, seconds_after_first: float) -> None:
        if tokens > 1:
            self.time_per_output_token.observe(seconds_after_first / (tokens - 1))

    def tokens(self, count: int) -> None:
        if count:
            self.generated.inc(count)

    def state(self, running: int, waiting: int, cache_positions: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.cache_tokens.set(cache_positions)
