"""IPv6: the gateway listens on both families with `--host ::`, reaches workers at IPv6
addresses (`http://[::1]:PORT`, `[fd00::5]:PORT`, EndpointSlice addresses) and names them
unambiguously in /workers and its metrics. On loopback, with ::1."""

from __future__ import annotations

import errno
import logging
import socket

import httpx
import openai
import pytest

import radixpool.listen
from bench.simfleet import SimConfig, SimFleet
from radixpool.gateway.config import GatewayConfig, normalize_worker_url
from radixpool.gateway.discovery import EndpointSliceState, slice_endpoints
from radixpool.gateway.server import GatewayServer
from radixpool.gateway.upstream import UpstreamPool
from radixpool.listen import listen_socket
from tests.ipv6_loopback import ipv6_loopback_missing

needs_ipv6 = pytest.mark.skipif(ipv6_loopback_missing() is not None,
                                reason=str(ipv6_loopback_missing()))


def _answers(family: int, address: str, port: int) -> bool:
    with socket.socket(family) as s:
        s.settimeout(10)
        s.connect((address, port))
        return True


@needs_ipv6
def test_all_addresses_accepts_ipv4_and_ipv6_connections():
    with listen_socket("::", 0) as sock:
        sock.listen()
        port = sock.getsockname()[1]
        assert _answers(socket.AF_INET, "127.0.0.1", port)
        assert _answers(socket.AF_INET6, "::1", port)


def test_all_addresses_falls_back_to_ipv4_where_ipv6_is_off(monkeypatch, caplog):
    real = socket.socket

    def no_ipv6(family=socket.AF_INET, *args, **kwargs):
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real(family, *args, **kwargs)

    monkeypatch.setattr(radixpool.listen.socket, "socket", no_ipv6)
    with caplog.at_level(logging.WARNING, logger="radixpool.listen"):
        sock = listen_socket("::", 0)
    with sock:
        assert sock.family == socket.AF_INET and sock.getsockname()[0] == "0.0.0.0"
        sock.listen()
        monkeypatch.undo()
        assert _answers(socket.AF_INET, "127.0.0.1", sock.getsockname()[1])
    assert "IPv6 is not available here" in caplog.text and "0.0.0.0" in caplog.text
    monkeypatch.setattr(radixpool.listen.socket, "socket", no_ipv6)
    with pytest.raises(OSError):   # an explicit IPv6 address is never silently replaced
        listen_socket("::1", 0)


def test_explicit_hosts_bind_as_given():
    with listen_socket("127.0.0.1", 0) as sock:
        assert sock.getsockname()[0] == "127.0.0.1"
    if ipv6_loopback_missing() is None:
        with listen_socket("[::1]", 0) as sock:
            assert sock.family == socket.AF_INET6 and sock.getsockname()[0] == "::1"


@pytest.mark.parametrize("given, url", [
    ("http://[::1]:8000", "http://[::1]:8000"),
    ("[fd00::5]:8000", "http://[fd00::5]:8000"),
    ("http://[FD00:0:0::5]:8000/", "http://[fd00::5]:8000"),
    ("10.0.0.7:8000", "http://10.0.0.7:8000"),
])
def test_worker_urls_with_ipv6_addresses_are_one_canonical_url(given, url):
    assert normalize_worker_url(given) == url


def test_the_same_ipv6_worker_written_two_ways_is_refused_as_listed_twice():
    with pytest.raises(ValueError, match="listed twice"):
        GatewayConfig(worker_urls=("[fd00::5]:8000", "http://[FD00:0::5]:8000"))


@pytest.mark.parametrize("given", ["fd00::5:8000", "http://[zz::1]:8000"])
def test_an_unbracketed_or_bad_ipv6_worker_url_is_refused_naming_it(given):
    with pytest.raises(ValueError, match=r"worker url .*(brackets|zz::1)"):
        normalize_worker_url(given)


def test_endpoint_slice_ipv6_addresses_become_bracketed_urls():
    ready, _ = slice_endpoints({"addressType": "IPv6", "ports": [{"name": "http", "port": 8000}],
                                "endpoints": [{"addresses": ["fd00:10:244::7"]}]}, "http")
    assert ready == {"http://[fd00:10:244::7]:8000"}


def _slice(name: str, family: str, *addresses: str) -> dict:
    return {"metadata": {"name": name}, "addressType": family,
            "ports": [{"name": "http", "port": 8000}],
            "endpoints": [{"addresses": [a]} for a in addresses]}


def test_an_ipv6_only_service_is_followed_whole():
    state = EndpointSliceState("http")
    state.replace([_slice("w-a", "IPv6", "fd00::7", "fd00::8")])
    assert state.workers() == ({"http://[fd00::7]:8000", "http://[fd00::8]:8000"}, set())


def test_a_dual_stack_service_gives_each_pod_once():
    """A dual-stack Service lists every pod in an IPv4 and an IPv6 slice: two workers per pod,
    each with half its traffic and a cache view of its own, before."""
    state = EndpointSliceState("http")
    state.replace([_slice("w-v4", "IPv4", "10.0.0.7", "10.0.0.8"),
                   _slice("w-v6", "IPv6", "fd00::7", "fd00::8")])
    assert state.workers() == ({"http://10.0.0.7:8000", "http://10.0.0.8:8000"}, set())
    state.apply("DELETED", _slice("w-v4", "IPv4"))   # the Service made single-stack IPv6
    assert state.workers() == ({"http://[fd00::7]:8000", "http://[fd00::8]:8000"}, set())


def test_requests_to_an_ipv6_worker_carry_a_bracketed_host_header():
    """RFC 9110 §7.2: an IPv6 host in `Host` is in brackets (`::1:8000` is no authority)."""
    request = UpstreamPool("::1", 8000, 1.0).encode("GET", "/health", [], b"")
    assert b"\r\nhost: [::1]:8000\r\n" in request


@needs_ipv6
def test_gateway_on_all_addresses_serves_an_ipv6_worker(loop_thread):
    fleet = SimFleet(1, SimConfig())
    loop_thread.run(fleet.start("::1"))
    worker_url = fleet.urls[0]
    assert worker_url.startswith("http://[::1]:")
    server = GatewayServer(GatewayConfig(worker_urls=(worker_url,), host="::", port=0,
                                         health_interval=3600.0))
    loop_thread.run(server.start())
    try:
        loop_thread.run(server.monitor.check(next(iter(server.gateway.workers))))
        for base in (f"http://127.0.0.1:{server.port}", f"http://[::1]:{server.port}"):
            assert httpx.get(base + "/health", timeout=10).status_code == 200
        client = openai.OpenAI(base_url=f"http://[::1]:{server.port}/v1", api_key="unused",
                               max_retries=0)
        reply = client.chat.completions.with_raw_response.create(
            model=SimConfig().model, messages=[{"role": "user", "content": "w1 w2 w3"}],
            max_tokens=4)
        assert reply.headers["x-radixpool-worker"] == worker_url
        assert reply.parse().choices[0].message.content
        listed = httpx.get(f"http://[::1]:{server.port}/workers", timeout=10).json()["workers"]
        assert [w["url"] for w in listed] == [worker_url] and listed[0]["healthy"]
        metrics = httpx.get(f"http://[::1]:{server.port}/metrics", timeout=10).text
        assert f'worker="{worker_url}"' in metrics
    finally:
        loop_thread.run(server.stop())
        loop_thread.run(fleet.stop())
