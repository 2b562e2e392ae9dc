"""``mha-deploy serve``: the HTTP (and gRPC) server."""

from __future__ import annotations

from pathlib import Path

import click

from mha_deploy.batching import BatchingConfig
from mha_deploy.cli.group import main
from mha_deploy.cli.options import RenamedOption, session_options

# ServeConfig.graceful_timeout_s (not imported: the serving package loads onnxruntime).
DEFAULT_DRAIN_TIMEOUT_S = 30.0


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; 0.0.0.0 exposes the server to the network.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--max-batch", type=click.IntRange(min=1), default=BatchingConfig.max_batch, show_default=True,
              help="Most requests run together in one padded batch; 1 turns micro-batching off.")
@click.option("--max-wait-ms", type=click.FloatRange(min=0), default=BatchingConfig.max_wait_ms, show_default=True,
              help="Longest a request waits for others to join its batch.")
@click.option("--max-batch-tokens", type=click.IntRange(min=1), default=BatchingConfig.max_batch_tokens,
              show_default=True,
              help="Most padded positions (requests x longest sequence) in one run; bounds its memory.")
@click.option("--workers", type=click.IntRange(min=1), default=BatchingConfig.workers, show_default=True,
              help="Batches run at once, each in its own thread.")
@session_options()
@click.option("--max-body-mb", type=click.FloatRange(min=0, min_open=True), default=64, show_default=True,
              help="Larger request bodies get 413.")
@click.option("--max-item-tokens", cls=RenamedOption, old_names=("--max-tokens",), type=click.IntRange(min=1),
              default=1024, show_default=True, help="Longest sequence one request may hold; longer ones get 422.")
@click.option("--optimized-model", type=click.Path(dir_okay=False, path_type=Path),
              help="Cache of ORT's optimized graph: written on the first start, reused for faster later starts.")
@click.option("--spin", is_flag=True,
              help="Let idle ORT threads spin-wait (off by default: it takes CPU from request handling).")
@click.option("--log-level", type=click.Choice(("debug", "info", "warning", "error")), default="info",
              show_default=True)
@click.option("--access-log", is_flag=True, help="Log every request (costs throughput).")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=DEFAULT_DRAIN_TIMEOUT_S, show_default=True,
              help="Seconds a SIGTERM waits for accepted requests to finish before the server exits anyway.")
@click.option("--name", help="Model name in the v2 protocol (/v2/models/NAME; default: the file's stem).")
@click.option("--grpc-port", type=click.IntRange(0, 65535),
              help="Also serve the v2 protocol over gRPC (inference.GRPCInferenceService) on this port.")
@click.option("--max-queue", type=click.IntRange(min=1), default=BatchingConfig.max_queue, show_default=True,
              help="Items waiting for a batch; beyond it requests get 503 with Retry-After (gRPC: UNAVAILABLE).")
@click.option("--api-key-file", type=click.Path(dir_okay=False, path_type=Path),
              help="File of API keys, one per line: every route but health then needs 'Authorization: Bearer KEY'.")
@click.option("--ssl-certfile", type=click.Path(dir_okay=False, path_type=Path),
              help="PEM certificate (chain): serve REST and gRPC over TLS (with --ssl-keyfile).")
@click.option("--ssl-keyfile", type=click.Path(dir_okay=False, path_type=Path), help="PEM private key for TLS.")
@click.option("--body-timeout", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Seconds a request body may take to arrive; slower ones get 408.")
@click.option("--max-connections", type=click.IntRange(min=1), default=1000, show_default=True,
              help="Requests (and gRPC calls) in progress at once, counted once authorised (health checks aside); "
                   "beyond it 503 (RESOURCE_EXHAUSTED). Idle connections take none.")
@click.option("--keep-alive-timeout", type=click.FloatRange(min=0, min_open=True), default=5.0, show_default=True,
              help="Seconds a connection with no request in progress stays open (new, or between requests).")
@click.option("--header-timeout", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Seconds a request's headers may take to arrive, from its first byte; then the connection closes.")
@click.option("--max-idle-connections", type=click.IntRange(min=1),
              help="Connections with no request in progress kept at once; beyond, the longest idle is closed "
                   "(default: half the open-file limit).")
@click.option("--tokenizer", type=click.Path(dir_okay=False, path_type=Path),
              help="A Hugging Face tokenizers file (tokenizer.json): a generator's text prompts and text out, an "
                   "encoder's texts on /v1/embeddings; without it, inputs are token ids. Default: the "
                   "tokenizer.json beside MODEL (export --hf writes it there), if any.")
@click.option("--chat-template", type=click.Path(dir_okay=False, path_type=Path),
              help="Generator: a jinja2 chat template over 'messages' (add_generation_prompt is true): enables "
                   "POST /v1/chat/completions. Default: the chat_template.jinja beside MODEL (export --hf writes it "
                   "there), if any.")
@click.option("--normalize-embeddings/--raw-embeddings", default=True, show_default=True,
              help="Encoder with a pooled output: POST /v1/embeddings returns unit-length (L2) vectors, as OpenAI's "
                   "do, or (--raw-embeddings) the model's output as it is.")
@click.option("--embedding-output", metavar="NAME",
              help="Encoder: the output /v1/embeddings serves ([batch, d] floats; default: the file's only such "
                   "output, BERT's pooler_output aside).")
@click.option("--max-kv-tokens", type=click.IntRange(min=1), default=65536, show_default=True,
              help="Generator: KV cache positions the running requests may hold, planned from each request's prompt "
                   "+ max_tokens; a request that does not fit waits (--max-queue), one that never fits gets 400.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Generator: the largest max_tokens a request may ask for.")
@click.option("--max-length", type=click.IntRange(min=1),
              help="Generator: prompt + max_tokens at most (a position table's size). Default: what the file records "
                   "(export --max-length), else no limit but --max-kv-tokens.")
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=512, show_default=True,
              help="Generator: prompt tokens prefilled per decode step; longer prompts prefill in chunks while the "
                   "running requests keep stepping.")
@click.option("--eos-id", "eos_ids", type=click.IntRange(min=0), multiple=True,
              help="Generator: token id that ends every sequence (kept in its output); repeatable. Default: the ids "
                   "recorded at export (export --eos-id).")
@click.option("--mix-lengths/--no-mix-lengths", default=None,
              help="Generator: let requests of different lengths share one cache (masked holes). Default: when the "
                   "file takes position_ids or its export recorded positions 'none'; otherwise a request shares steps "
                   "only with rows of its exact length, so that its positions are as alone.")
@click.option("--max-choices", type=click.IntRange(min=1), default=16, show_default=True,
              help="Generator: sequences (n x prompts) one request may ask for.")
@click.option("--encoder", type=click.Path(dir_okay=False, path_type=Path),
              help="Generator: an encoder-decoder's encoder file (MODEL is then its decoder); a prompt is its "
                   "source. Default: the encoder a decoder exported with --kv-cache names (written beside it).")
@click.option("--start-id", type=click.IntRange(min=0),
              help="Generator: the decoder start id of an encoder-decoder (default: the one recorded at export).")
@click.option("--ray-replicas", type=click.IntRange(min=1),
              help="Run N replicas of this server as a Ray Serve deployment behind Ray Serve's HTTP proxy (on "
                   "--host/--port), each with --threads ORT threads (default 1) and as many CPUs reserved; needs the "
                   "'ray' extra and the model file at the same path on every node.")
@click.option("--ray-address",
              help="With --ray-replicas: the Ray cluster to join (default: $RAY_ADDRESS or the one last started on "
                   "this machine, else a local one for this run).")
@click.option("--ray-autoscaling", metavar="JSON|FILE",
              help="Ray Serve's autoscaling_config (a JSON object or a JSON file), e.g. '{\"min_replicas\": 1, "
                   "\"max_replicas\": 4, \"target_ongoing_requests\": 32}': replicas follow the load instead of "
                   "--ray-replicas.")
def serve(model, host, port, max_batch, max_wait_ms, max_batch_tokens, workers, provider, threads, max_body_mb,
          max_item_tokens, optimized_model, spin, log_level, access_log, drain_timeout, name, grpc_port, max_queue,
          api_key_file, ssl_certfile, ssl_keyfile, body_timeout, max_connections, keep_alive_timeout,
          header_timeout, max_idle_connections, tokenizer, chat_template, max_kv_tokens, max_new_tokens, max_length,
          prefill_chunk, eos_ids, mix_lengths, max_choices, encoder, start_id, ray_replicas, ray_address,
          ray_autoscaling, normalize_embeddings, embedding_output):
    """Serve a model over HTTP (and gRPC) with dynamic micro-batching (needs the 'serve' extra).

    The Open Inference Protocol (KServe v2, what Triton's and KServe's clients
    speak): GET /v2, /v2/models/NAME, /v2/health/live|ready, POST
    /v2/models/NAME/infer with JSON or binary tensors; over gRPC with --grpc-port.
    POST /v1/infer takes {"x": [[...d_model floats] x seq]} (cross-attention: query, key,
    value) as JSON, an .npy body (application/x-npy) or an .npz body (application/x-npz).
    All share one micro-batcher. GET /healthz, /readyz and /metrics (Prometheus) are
    for orchestration. SIGTERM finishes every accepted request (up to --drain-timeout)
    before exiting.

    A KV-cache decoder (export --module ... --kv-cache, or Optimum's cache names) is
    served as a generator with continuous batching: OpenAI's POST /v1/completions,
    /v1/chat/completions (with --chat-template) and GET /v1/models, streaming as
    server-sent events; Triton's POST /v2/models/NAME/generate and /generate_stream.
    --max-batch is then the most requests decoding at once, --max-queue the most
    waiting for the KV budget (beyond: 429 with Retry-After). An encoder-decoder that
    export --kv-cache wrote (mt.onnx and mt.encoder.onnx) is served from its decoder:
    the encoder it names is found, a prompt is the source.

    \b
    Examples:
      mha-deploy serve mha.onnx --port 8000 --grpc-port 8001 --max-batch 32 --max-wait-ms 2
      curl -s localhost:8000/v1/infer -H 'Content-Type: application/json' -d '{"x": [[0.1, ...]]}'
      curl -s localhost:8000/v2/models/mha
      mha-deploy serve lm.onnx --tokenizer tokenizer.json --eos-id 0 --max-kv-tokens 32768
      curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "lm", "prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}'
      mha-deploy serve lm.onnx --tokenizer tokenizer.json --ray-replicas 2 --threads 1
    """
    from mha_deploy.runtime.beside_model import BesideModel
    from mha_deploy.serving.http import EmbeddingOptions, GenerationOptions, ServeConfig
    from mha_deploy.serving.http import serve as run_server
    from mha_deploy.serving.http.parsing import RequestLimits

    # export --hf writes the tokenizer and chat template beside the model: taken when no flag names others
    tokenizer, chat_template = BesideModel.of(model).resolve(tokenizer, chat_template, lambda line: click.echo(
        line, err=True))
    limits = RequestLimits(
        max_body_bytes=int(max_body_mb * 2**20), max_item_tokens=max_item_tokens, body_timeout_s=body_timeout
    )
    batching = BatchingConfig(max_batch=max_batch, max_wait_ms=max_wait_ms, workers=workers, max_queue=max_queue,
                              max_batch_tokens=max_batch_tokens)
    config = ServeConfig(
        model, host=host, port=port, provider=provider, threads=threads, batching=batching, limits=limits,
        optimized_model_path=optimized_model, spin=spin, log_level=log_level, access_log=access_log,
        graceful_timeout_s=drain_timeout, name=name, grpc_port=grpc_port, api_key_file=api_key_file,
        ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile, max_connections=max_connections,
        keep_alive_timeout_s=keep_alive_timeout, header_timeout_s=header_timeout,
        max_idle_connections=max_idle_connections,
        generation=GenerationOptions(
            tokenizer=tokenizer, chat_template=chat_template, max_kv_tokens=max_kv_tokens,
            max_new_tokens=max_new_tokens, max_length=max_length, prefill_chunk=prefill_chunk,
            eos_token_ids=tuple(eos_ids), mix_lengths=mix_lengths, max_choices=max_choices, encoder=encoder,
            start_id=start_id,
        ),
        embeddings=EmbeddingOptions(normalize=normalize_embeddings, output=embedding_output),
    )
    if ray_replicas is None and ray_autoscaling is None:
        if ray_address is not None:
            raise click.UsageError("--ray-address needs --ray-replicas or --ray-autoscaling")
        run_server(config)
        return
    from mha_deploy.serving.ray_serve import RayServeOptions, read_autoscaling, serve_on_ray

    options = RayServeOptions(
        replicas=ray_replicas or 1, address=ray_address,
        autoscaling=read_autoscaling(ray_autoscaling) if ray_autoscaling is not None else None,
    )
    serve_on_ray(config, options, on_ready=lambda url: click.echo(
        f"serving {config.model_name} on Ray Serve at {url} (Ctrl+C stops it)", err=True))
