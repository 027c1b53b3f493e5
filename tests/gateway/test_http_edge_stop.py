"""Stopping the gateway's HTTP edge with clients in every state: an answer being computed
finishes, an idle keep-alive connection closes at once, and whatever is left when the grace
period ends is cut with every handler ended (none cancelled mid-flight as a failure)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from tests.gateway.test_http_edge import Responses, connect, read_until_closed


def test_stop_finishes_answers_closes_idle_connections_and_ends_every_handler(
        loop_thread, monkeypatch):
    from radixpool.gateway import http_edge

    monkeypatch.setattr(http_edge, "CLOSE_GRACE_S", 1.0)

    async def app(request, respond) -> None:
        if request.path == "/slow":
            await asyncio.sleep(0.5)
            await respond.send(200, [], b"done")
        else:   # a stream that would never end
            await respond.start(200, [])
            while True:
                await asyncio.sleep(0.05)
                await respond.write(b"x")

    errors = []
    uvicorn_log = logging.getLogger("uvicorn.error")
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append
    server = http_edge.EdgeServer(app, "127.0.0.1", 0, http_edge.EdgeLimits())
    loop_thread.run(server.start())
    uvicorn_log.addHandler(handler)   # after start: uvicorn's logging setup drops handlers
    url = f"http://127.0.0.1:{server.port}"
    try:
        idle, slow, endless, half_body = (connect(url) for _ in range(4))
        idle.sendall(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        idle.settimeout(5)
        answer = b""
        while not answer.endswith(b"done"):
            answer += idle.recv(65536)   # now idle, kept alive
        slow.sendall(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        endless.sendall(b"GET /endless HTTP/1.1\r\nhost: x\r\n\r\n")
        half_body.sendall(b"POST /slow HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n01234")
        time.sleep(0.2)
        stopped = {}

        async def stop_and_count() -> int:
            await server.stop()
            return len(server._state.tasks)

        def stop() -> None:
            started = time.monotonic()
            stopped["handlers"] = loop_thread.run(stop_and_count())
            stopped["after"] = time.monotonic() - started

        stopping = threading.Thread(target=stop)
        stopping.start()
        started = time.monotonic()
        assert read_until_closed(idle, 5) == b"" and time.monotonic() - started < 0.5
        assert Responses(read_until_closed(slow, 5)).messages == [(200, b"done")]
        stopping.join(10)
        assert stopped["after"] < 3.0   # the grace period, then the rest is cut
        assert stopped["handlers"] == 0   # every handler ended before stop() returned
        assert not errors, [record.getMessage() for record in errors]   # none cut as a failure
        for sock in (idle, slow, endless, half_body):
            sock.close()
    finally:
        uvicorn_log.removeHandler(handler)
