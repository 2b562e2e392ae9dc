"""The HTTP server: an ASGI app (Starlette) with dynamic micro-batching, run by uvicorn.

Needs the ``serve`` extra (``pip install "mha-deploy[serve]"``). ``mha_deploy.serving``
does not import this package, and this package imports starlette and uvicorn only
in ``app`` and ``serve``, so embedding ``MHASession`` needs neither.

- ``parsing``: request bodies -> one checked item (no starlette)
- ``batcher``: ``MicroBatcher``, grouping concurrent items into padded runs
- ``metrics``: the Prometheus metrics
- ``app``: ``create_app``, the routes
- ``server``: ``serve``, uvicorn with graceful shutdown
"""

from mha_deploy.serving.http.server import ServeConfig, ServeError, serve

__all__ = ["ServeConfig", "ServeError", "serve"]
