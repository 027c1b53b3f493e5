"""Feedback from workers that do not say everything: answers without `cached_tokens` (unknown, not
zero), and SGLang servers that describe themselves at `/get_server_info`."""

from __future__ import annotations

import http.server
import json
import random
import threading
import time

import openai

from bench.sim_no_cached import omit_cached_tokens, strip_cached
from radixpool.gateway.feedback import usage_in
from radixpool.gateway.prefix_index import PrefixIndex
from radixpool.gateway.worker_info import parse_server_info
from tests.gateway.conftest import words
from tests.gateway.test_prefix_index import chain


def test_an_answer_without_cached_tokens_reports_it_as_unknown():
    assert usage_in(b'{"usage": {"prompt_tokens": 12, "completion_tokens": 3}}') == (12, None)
    assert usage_in(b'{"usage": {"prompt_tokens": 12, "prompt_tokens_details": null}}') \
        == (12, None)
    assert usage_in(b'{"usage": {"prompt_tokens": 12, "prompt_tokens_details": '
                    b'{"cached_tokens": 0}}}') == (12, 0)
    stripped = strip_cached(b'{"usage": {"prompt_tokens": 9, "total_tokens": 11, '
                            b'"prompt_tokens_details": {"cached_tokens": 8}}}')
    assert json.loads(stripped) == {"usage": {"prompt_tokens": 9, "total_tokens": 11}}


def serve_groups(stack, groups: int = 6, requests: int = 48) -> dict[int, set[int]]:
    """Shared-prefix traffic, groups in a seeded random order (half streamed); returns
    group → the workers that served it after its first request."""
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    served: dict[int, set[int]] = {g: set() for g in range(groups)}
    rng = random.Random(0)
    for q in range(requests):
        g = rng.randrange(groups)
        raw = client.chat.completions.with_raw_response.create(
            model="sim-model", max_tokens=2, stream=q % 2 == 1,
            messages=[{"role": "system", "content": words(g * 500, 300)},
                      {"role": "user", "content": words(3000 + q * 7, 6)}])
        if q % 2:
            list(raw.parse())  # read the stream to its end
        if q >= groups:
            served[g].add(stack.worker_of(raw.http_response))
    return served


def test_workers_that_never_report_cached_tokens_keep_their_trees(make_stack):
    stack = make_stack(3, kv_events=False)
    for worker in stack.fleet.workers:
        omit_cached_tokens(worker)
    served = serve_groups(stack)
    stack.settle()
    # an absent report read as "0 cached" trimmed the tree after every answer and scattered
    # the groups (hit rate 0.69 here); unknown trims nothing, so each group stays where its
    # prefix is (0.85)
    assert all(len(workers) <= 1 for workers in served.values()), served
    assert stack.fleet.stats()["hit_rate"] > 0.8
    rows = stack.client.get("/workers").json()["workers"]
    assert {row["tree_source"] for row in rows} == {"lru"}
    assert all("cached_tokens" not in row["tree_corrections"] for row in rows)
    assert sum(row["unreported_answers"] for row in rows) == 48
    assert sum(row["prompt_tokens"] for row in rows) == 0  # no made-up hit rate either


def test_the_workers_view_names_each_trees_source(make_stack):
    reporting = make_stack(2, kv_events=False)
    serve_groups(reporting, groups=4, requests=8)
    reporting.settle()
    rows = reporting.client.get("/workers").json()["workers"]
    assert [row["tree_source"] for row in rows if row["requests"]] == ["cached_tokens"] * 2

    silent_with_events = make_stack(2)
    for worker in silent_with_events.fleet.workers:
        omit_cached_tokens(worker)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the KV-event streams start following shortly after
        rows = silent_with_events.client.get("/workers").json()["workers"]
        if {row["tree_source"] for row in rows} == {"kv_events"}:
            break
        time.sleep(0.05)
    assert {row["tree_source"] for row in rows} == {"kv_events"}
    served = serve_groups(silent_with_events, groups=2, requests=8)
    assert all(len(workers) <= 1 for workers in served.values()), served


def test_a_stream_that_ends_without_any_usage_counts_as_unreported(make_stack):
    """A server that never sends the usage event a stream was asked for (an OpenAI-compatible
    server without usage in streams): each whole answer is counted as unreported, not passed
    over as if it had not happened."""
    stack = make_stack(1, kv_events=False)
    worker = stack.fleet.workers[0]
    stream = worker._stream

    async def stream_without_usage(path, doc, *args):
        await stream(path, {k: v for k, v in doc.items() if k != "stream_options"}, *args)

    worker._stream = stream_without_usage
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    for q in range(3):
        chunks = list(client.chat.completions.create(
            model="sim-model", max_tokens=2, stream=True,
            messages=[{"role": "user", "content": words(q * 50, 20)}]))
        assert chunks and all(c.usage is None for c in chunks)
    stack.settle()
    row = stack.client.get("/workers").json()["workers"][0]
    assert (row["unreported_answers"], row["prompt_tokens"]) == (3, 0), row


SGLANG_INFO = {"model_path": "Qwen/Qwen2.5-0.5B-Instruct", "served_model_name": "qwen",
               "context_length": None, "page_size": 1, "tp_size": 1,
               "max_total_num_tokens": 123456, "max_req_input_len": 32000,
               "internal_states": [{"last_gen_throughput": 0.0}], "version": "0.5.0"}


def test_sglang_server_info_gives_the_kv_capacity():
    info = parse_server_info(SGLANG_INFO)
    assert info is not None and info.kv_capacity_tokens == 123456
    assert info.served_model_name == "qwen" and not info.kv_events
    nested = {**SGLANG_INFO, "max_total_num_tokens": None,
              "internal_states": [{"max_total_num_tokens": 777}]}
    assert parse_server_info(nested).kv_capacity_tokens == 777
    assert parse_server_info({"model_path": "x"}) is None
    assert parse_server_info({"instance_id": "a", "kv_capacity_tokens": 5}) is None  # malformed


def test_sglang_server_info_names_its_eviction_policy_and_slru_protects_reuse():
    assert parse_server_info(SGLANG_INFO).eviction_policy == "lru"  # SGLang's default
    # and its scheduler's order: an lpm one runs cache hits ahead, as ours does
    assert parse_server_info(SGLANG_INFO).schedule_policy == "fcfs"
    assert parse_server_info({**SGLANG_INFO, "schedule_policy": "lpm"}).schedule_policy == "lpm"
    index = PrefixIndex()
    history = chain(list(range(80)))  # 20 blocks, reused by a later request
    for policy, protects in (("slru", True), ("lfu", True), ("fifo", False), ("lru", False)):
        info = parse_server_info({**SGLANG_INFO, "radix_eviction_policy": policy})
        assert info.eviction_policy == policy
        index.add_worker(policy, 64)
        index.set_eviction_policy(policy, info.eviction_policy)
        index.insert(policy, history)
        index.insert(policy, history, matched=20)
        assert index.room(policy) == (44 if protects else 64), policy


class _SGLangLike(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/health":
            self._answer(200, b"")
        elif self.path == "/get_server_info":
            self._answer(200, json.dumps(SGLANG_INFO).encode())
        else:
            self._answer(404, b'{"detail": "Not Found"}')

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_an_sglang_worker_sizes_its_tree_from_max_total_num_tokens(make_stack):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SGLangLike)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        stack = make_stack(1, tree_capacity_tokens=1000)
        worker = stack.loop.call(stack.gateway.workers.add, url)
        stack.loop.run(stack.server.monitor.check(worker))
        row = next(r for r in stack.client.get("/workers").json()["workers"] if r["url"] == url)
        assert row["kv_capacity_tokens"] == 123456 and row["model"] == "qwen"
        assert (row["eviction_policy"], row["schedule_policy"]) == ("lru", "fcfs")  # SGLang's
        assert row["tree_capacity_blocks"] > 1000  # from its capacity, not the 1000-token fallback
    finally:
        server.shutdown()
        server.server_close()
