"""The HTTP transport under the agents' openai clients: HTTP/1.1 to this engine's gateway.

Owns: ``LocalTransport``, an ``httpx2`` transport (what the ``openai`` client sends
through) that speaks plain HTTP/1.1 over keep-alive TCP connections to one gateway on
this machine, and ``local_http_client`` (the shared client of every session's
``AsyncOpenAI``, on it). The requests are real HTTP on real sockets, the gateway
(``workers.rollout.gateway``) serves them as any client's; what this skips is a general
client's machinery the gateway never needs (TLS, proxies, redirects, chunked or
compressed bodies, HTTP/2): on the one core the agents, the gateway and the engine share,
httpx's own transport took about a third of a turn's CPU and aiohttp's a fifth
(docs/benchmarks.md). A response must carry Content-Length (the gateway's always do);
anything else is a protocol error, as is a connection closed mid-response. An idle
connection is reused while younger than ``REUSE_S``, half the time after which the
gateway's server closes it (``workers.rollout.gateway.KEEP_ALIVE_S``); a request
cancelled midway closes its connection. Runs on
the agents' event loop only.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx2

REUSE_S = 30.0
"""How long an idle connection is reused (the gateway's server closes it after 60 s)."""
_MAX_HEAD = 65536


class LocalTransport(httpx2.AsyncBaseTransport):
    """See the module docstring."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[tuple[float, asyncio.StreamReader,
                                                     asyncio.StreamWriter]]] = {}
        self.opened = 0
        """Connections opened (one per request in flight at the busiest, then reused)."""

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        url = request.url
        if url.scheme != "http" or url.host is None:
            raise httpx2.UnsupportedProtocol(f"{url}: plain http to a host only")
        address = (url.host, url.port or 80)
        timeout = request.extensions.get("timeout", {})
        body = await request.aread()
        head = [f"{request.method} {url.raw_path.decode('ascii')} HTTP/1.1\r\n".encode()]
        head += [name + b": " + value + b"\r\n" for name, value in request.headers.raw
                 if name.lower() not in (b"content-length", b"transfer-encoding")]
        head.append(b"content-length: %d\r\n\r\n" % len(body))
        reader, writer = await self._connection(address, timeout.get("connect"))
        done = False
        try:
            writer.write(b"".join(head) + body)
            async with asyncio.timeout(timeout.get("read")):
                await writer.drain()
                status, headers, length, close = _head(await reader.readuntil(b"\r\n\r\n"))
                content = await reader.readexactly(length)
            done = not close
        except TimeoutError:
            raise httpx2.ReadTimeout("the gateway did not answer in time",
                                     request=request) from None
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError,
                ValueError) as err:
            raise httpx2.RemoteProtocolError(f"the gateway's response: {err}",
                                             request=request) from None
        finally:
            if done:
                self._idle.setdefault(address, []).append((time.monotonic(), reader, writer))
            else:
                writer.close()
        return httpx2.Response(status, headers=headers, content=content, request=request,
                               extensions={"http_version": b"HTTP/1.1"})

    async def _connection(self, address: tuple[str, int], timeout_s: float | None
                          ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        idle = self._idle.get(address, [])
        while idle:
            since, reader, writer = idle.pop()
            if time.monotonic() - since < REUSE_S and not reader.at_eof():
                return reader, writer
            writer.close()
        try:
            async with asyncio.timeout(timeout_s):
                connection = await asyncio.open_connection(*address, limit=_MAX_HEAD)
        except TimeoutError:
            raise httpx2.ConnectTimeout(f"no connection to {address} in time") from None
        except OSError as err:
            raise httpx2.ConnectError(f"no connection to {address}: {err}") from None
        self.opened += 1
        return connection

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for _, _, writer in idle:
                writer.close()
        self._idle.clear()


def _head(raw: bytes) -> tuple[int, list[tuple[bytes, bytes]], int, bool]:
    """A response head: (status, headers, the body's length, whether the server closes
    the connection after it). ``ValueError`` for one without Content-Length."""
    lines = raw[:-4].split(b"\r\n")
    version, status, *_ = lines[0].split(b" ", 2)
    if not version.startswith(b"HTTP/1."):
        raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers: list[tuple[bytes, bytes]] = []
    length, close = -1, version == b"HTTP/1.0"
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip()
        headers.append((name, value))
        if name == b"content-length":
            length = int(value)
        elif name == b"connection":
            close = value.lower() == b"close"
        elif name == b"transfer-encoding":
            raise ValueError("a chunked body (the gateway sends Content-Length)")
    if length < 0:
        raise ValueError("no Content-Length")
    return int(status), headers, length, close


def local_http_client(**kwargs: Any) -> Any:
    """The openai client's default async HTTP client (its timeouts and headers) on a
    ``LocalTransport``; ``aclose`` leaves it open (every session's client shares it),
    ``close_pool`` closes it."""
    import openai

    class Shared(openai.DefaultAsyncHttpxClient):
        async def aclose(self) -> None:
            return None

        async def close_pool(self) -> None:
            await super().aclose()

    return Shared(transport=LocalTransport(), **kwargs)
