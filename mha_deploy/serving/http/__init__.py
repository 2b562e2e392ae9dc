"""The HTTP server: an ASGI app (Starlette) with dynamic micro-batching, run by uvicorn.

Needs the ``serve`` extra (``pip install "mha-deploy[serve]"``). ``mha_deploy.serving``
does not import this package, and this package imports starlette and uvicorn only
in ``app`` and ``serve``, so embedding ``MHASession`` needs neither.

- ``parsing``: /v1 request bodies -> one checked item (no starlette)
- ``batcher``: ``MicroBatcher``, grouping concurrent items into padded runs
- ``service``: ``InferenceService``, what every protocol shares (session, batcher, readiness)
- ``v2``: the Open Inference Protocol without a transport: metadata, tensors, batch requests
  split into items and put back
- ``rest_v2``: the protocol's REST routes, with the binary tensor data extension
- ``grpc_server``: the protocol over gRPC (grpc.aio, tritonclient's stubs), same event loop
- ``auth``: API keys; ``body``: reading a body within size and time limits
- ``metrics``: the Prometheus metrics
- ``app``: ``create_app``, the /v1 routes and the app's lifetime
- ``embeddings``: OpenAI's /v1/embeddings over an encoder's pooled output, through the same batcher
- ``prompt_ids``: text or token ids in, as OpenAI's routes take them (prompts, embeddings' input)
- ``engine`` (``mha_deploy.serving.engine``), ``generation``, ``openai_routes``, ``triton_generate``,
  ``generation_app``: a KV-cache decoder served as a generator (continuous batching)
- ``server``: ``serve``, uvicorn (and gRPC) with TLS, limits and graceful shutdown
"""

from mha_deploy.serving.http.server import EmbeddingOptions, GenerationOptions, ServeConfig, ServeError, serve

__all__ = ["EmbeddingOptions", "GenerationOptions", "ServeConfig", "ServeError", "serve"]
