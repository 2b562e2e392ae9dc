"""Reading a request body within the size and time limits (shared by every REST route that takes one).

A body larger than the limit is refused as soon as that is known (from
Content-Length, or while it arrives when chunked). A body that takes longer
than ``body_timeout_s`` to arrive, such as a client that stalls halfway or
trickles bytes, gets a 408: it cannot hold a connection, a file descriptor or
a SIGTERM drain for longer than that.
"""

from __future__ import annotations

import asyncio

from mha_deploy.serving.http.parsing import RequestError, RequestLimits, is_decimal, load_json
from mha_deploy.serving.http.service import THREAD_THRESHOLD_BYTES

_timeout = getattr(asyncio, "timeout", None)  # Python >= 3.11


async def read_body(request, limits: RequestLimits) -> bytes:
    """The whole body of a Starlette ``request``, or a ``RequestError`` (400, 408, 413)."""
    max_bytes = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None:
        if not is_decimal(declared):
            raise RequestError(400, "bad_content_length", f"Content-Length {declared!r} is not a number")
        if int(declared) > max_bytes:
            raise _too_large(max_bytes)
    try:
        if _timeout is None:  # Python 3.10
            return await asyncio.wait_for(_read(request, max_bytes), limits.body_timeout_s)
        async with _timeout(limits.body_timeout_s):  # no task per request, unlike wait_for
            return await _read(request, max_bytes)
    except (TimeoutError, asyncio.TimeoutError):  # distinct types before Python 3.11
        raise RequestError(
            408, "body_timeout", f"the request body did not arrive within {limits.body_timeout_s:g} s"
        ) from None


async def read_json(request, limits: RequestLimits) -> object:
    """The body of a Starlette ``request`` parsed as JSON (in a thread when large), or a ``RequestError``."""
    body = await read_body(request, limits)
    if len(body) > THREAD_THRESHOLD_BYTES:
        return await asyncio.to_thread(load_json, body)
    return load_json(body)


async def _read(request, max_bytes: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(max_bytes: int) -> RequestError:
    return RequestError(413, "body_too_large", f"request body exceeds this server's limit of {max_bytes} bytes")
