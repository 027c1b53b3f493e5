"""Flow control on the gateway's worker connections: a response the proxy does not take (its
client reads slowly) stops being read from the worker, so it waits in the worker's socket, not in
the gateway's memory; once taken, every byte arrives in order."""

from __future__ import annotations

import asyncio

from radixpool.gateway.upstream import UpstreamPool

PIECE = bytes(range(256)) * 256   # 64 KiB
PIECES = 1024                     # 64 MiB in all


async def serve_big_stream(sent: list[int], reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    for _ in range(PIECES):
        writer.write(b"%x\r\n%s\r\n" % (len(PIECE), PIECE))
        await writer.drain()   # waits while the gateway does not read
        sent.append(len(PIECE))
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    writer.close()


def test_a_response_the_proxy_does_not_take_is_held_back_at_the_worker():
    async def scenario() -> None:
        sent: list[int] = []
        worker = await asyncio.start_server(
            lambda r, w: serve_big_stream(sent, r, w), "127.0.0.1", 0)
        port = worker.sockets[0].getsockname()[1]
        pool = UpstreamPool("127.0.0.1", port, connect_timeout=5)
        try:
            response = await pool.request("POST", "/v1/completions", body=b"{}")
            await asyncio.sleep(1.5)   # the proxy's client reads nothing meanwhile
            # before: the whole 64 MiB was read into the gateway within the pause
            assert sum(sent) < 16 << 20, f"{sum(sent) >> 20} MiB taken from the worker"
            got = await asyncio.wait_for(response.body(), 60)
            assert len(got) == len(PIECE) * PIECES and got == PIECE * PIECES
        finally:
            pool.close()
            worker.close()
    asyncio.run(scenario())
