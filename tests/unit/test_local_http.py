"""The agents' HTTP/1.1 transport (``workers.rollout.local_http``) against small servers of
its own: keep-alive reuse, stale connections, and every response it cannot take an
error the openai client maps (never a hang, never another request's body)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx2
import pytest

from workers.rollout import local_http
from workers.rollout.local_http import LocalTransport, local_http_client

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers each request on the connection with its own path and body."""
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            break
        lines = head.decode().split("\r\n")
        length = next(int(v) for k, _, v in (h.partition(": ") for h in lines[1:])
                      if k == "content-length")
        body = lines[0].split(" ")[1].encode() + b"|" + await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
    writer.close()


def serving(handler: Handler, test: Callable[[str], Awaitable[None]]) -> None:
    async def main() -> None:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            await test(f"http://127.0.0.1:{port}")
        finally:
            server.close()

    asyncio.run(main())


def test_requests_side_by_side_reuse_their_connections() -> None:
    async def test(url: str) -> None:
        transport = LocalTransport()
        async with httpx2.AsyncClient(transport=transport) as client:
            for _ in range(3):
                replies = await asyncio.gather(*(client.post(f"{url}/v1/x", content=b"%d" % k)
                                                 for k in range(5)))
                assert [r.text for r in replies] == [f"/v1/x|{k}" for k in range(5)]
                assert all(r.status_code == 200 for r in replies)
        assert transport.opened == 5  # one per request in flight, then kept alive

    serving(echo, test)


def test_an_idle_connection_past_keep_alive_is_not_reused(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setattr(local_http, "REUSE_S", 0.0)

    async def test(url: str) -> None:
        transport = LocalTransport()
        async with httpx2.AsyncClient(transport=transport) as client:
            assert (await client.get(f"{url}/a")).text == "/a|"
            assert (await client.get(f"{url}/b")).text == "/b|"
        assert transport.opened == 2

    serving(echo, test)


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nabc",
    b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc",  # then closed: cut short
    b"SSH-2.0-nope\r\n\r\n",
    b"",
])
def test_a_response_it_cannot_take_is_a_protocol_error(reply: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(reply)
        await writer.drain()
        writer.close()

    async def test(url: str) -> None:
        async with httpx2.AsyncClient(transport=LocalTransport()) as client:
            with pytest.raises(httpx2.RemoteProtocolError):
                await client.get(f"{url}/a")

    serving(handler, test)


def test_no_answer_is_a_read_timeout_and_no_server_a_connect_error() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    async def test(url: str) -> None:
        async with httpx2.AsyncClient(transport=LocalTransport(), timeout=0.2) as client:
            with pytest.raises(httpx2.ReadTimeout):
                await client.get(f"{url}/a")
            with pytest.raises(httpx2.ConnectError):
                await client.get("http://127.0.0.1:1/a")
            with pytest.raises(httpx2.UnsupportedProtocol):
                await client.get("https://127.0.0.1:1/a")

    serving(silent, test)


def test_the_shared_client_outlives_a_session_s_close() -> None:
    async def test(url: str) -> None:
        client = local_http_client()
        await client.aclose()  # a session's client.close()
        assert (await client.get(f"{url}/a")).text == "/a|"
        await client.close_pool()
        assert client.is_closed

    serving(echo, test)
