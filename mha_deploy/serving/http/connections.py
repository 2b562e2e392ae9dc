"""REST connections: deadlines for idle connections and for request headers, and slots for requests.

uvicorn's own limit (``limit_concurrency``) counts open connections, and it
closes an idle connection only after a response (keep-alive): connections that
connect and send nothing, or send no valid key, took every slot, and a new one
(or a TLS one after its handshake) stayed open forever. So here:

- ``deadline_protocol``: uvicorn's HTTP protocol with two deadlines. A
  connection with no request in progress is closed after ``idle_timeout_s``
  (from when it opens: after the TLS handshake for TLS; uvicorn's keep-alive
  timeout covers the time between requests), and a request's headers must be
  complete within ``header_timeout_s`` of its first byte. The body has its own
  deadline (``body.read_body``). And a cap: beyond ``max_idle`` connections
  with no request in progress, the one idle the longest is closed, so that a
  flood of idle sockets cannot use up the process's file descriptors within
  one idle timeout (a client sends its request at once, so it is idle only
  for a moment).
- ``RequestSlots``: the ASGI middleware that admits at most ``limit`` requests
  at once, 503 beyond. It sits inside the API key check, so a request takes a
  slot only once authorised, and connections without a request take none.
  Health checks take no slot: an orchestrator's probe is not turned away by load.
"""

from __future__ import annotations

from collections import OrderedDict

from starlette.responses import JSONResponse
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from mha_deploy.serving.http.auth import is_health_path


def deadline_protocol(idle_timeout_s: float, header_timeout_s: float, max_idle: int) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol closing idle connections (after ``idle_timeout_s``, or the longest idle
    beyond ``max_idle`` of them) and connections whose headers come too slowly."""
    idle: OrderedDict[HttpToolsProtocol, None] = OrderedDict()  # this server's idle connections, oldest first

    class DeadlineHttpProtocol(HttpToolsProtocol):
        _deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm(idle_timeout_s)
            self._idle()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            idle.pop(self, None)
            self._arm(header_timeout_s)

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.timeout_keep_alive_task is not None:  # armed only when no pipelined request started
                self._idle()

        def connection_lost(self, exc) -> None:
            idle.pop(self, None)
            self._disarm()
            super().connection_lost(exc)

        def _idle(self) -> None:
            idle[self] = None
            while len(idle) > max_idle:
                oldest, _ = idle.popitem(last=False)
                oldest.transport.close()

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return DeadlineHttpProtocol


class RequestSlots:
    """ASGI middleware: at most ``limit`` requests (health checks aside) in the app at once; 503 beyond."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit
        self.in_use = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or is_health_path(scope["path"]):
            return await self.app(scope, receive, send)
        if self.in_use >= self.limit:
            message = f"the server is handling its limit of {self.limit} requests; retry shortly"
            response = refusal(scope["path"], 503, "overloaded", message, {"Retry-After": "1"})
            return await response(scope, receive, send)
        self.in_use += 1
        try:
            return await self.app(scope, receive, send)
        finally:
            self.in_use -= 1


def refusal(path: str, status: int, kind: str, message: str, headers: dict[str, str]) -> JSONResponse:
    """A request refused before its route ran, in the route's error format (``/v2``: ``{"error": message}``,
    else ``{"error": {"kind", "message"}}``). The connection closes: the request's body, if any, is unread."""
    if path.startswith(("/v1/completions", "/v1/chat/completions", "/v1/models")):  # OpenAI's clients read its shape
        body = {"error": {"message": message, "type": kind, "param": None, "code": kind}}
    elif path.startswith("/v2"):
        body = {"error": message}
    else:
        body = {"error": {"kind": kind, "message": message}}
    return JSONResponse(body, status_code=status, headers={**headers, "Connection": "close"})
