"""Serving benchmark client for any OpenAI-compatible endpoint (RadixPool worker or gateway,
SGLang, vLLM, ...), and a measurement of a RadixPool worker's own per-request overhead.

    python bench/serving.py run --base-url http://127.0.0.1:8000 --workload shared-prefix \
        --num-requests 200 --request-rate 20          # Poisson arrivals, 20 req/s
    python bench/serving.py run --base-url ... --workload multi-turn --concurrency 8   # closed loop
    python bench/serving.py overhead --base-url http://127.0.0.1:8000 --model DIR

`run` streams every request (`stream_options.include_usage`) and prints throughput, TTFT / ITL /
end-to-end latency percentiles and the cache hit rate the server reported in
`usage.prompt_tokens_details.cached_tokens`. Workloads: `random` (unrelated prompts),
`shared-prefix` (a few long system prompts, each shared by many requests) and `multi-turn`
(conversations whose every turn resends the whole history). Prompt lengths are in words.

`overhead` measures what the server adds to one request apart from the model, with sequential
`max_tokens=1` chat requests (so the chat template and tokenizer count):
- `server_overhead_p50_ms`: the median over requests of HTTP latency minus the time that same
  request spent in the engine core, which a RadixPool worker reports in its `Server-Timing:
  engine;dur=MS` header (from its arrival in the core to its last token: queue, scheduler,
  forward, sampling). The rest — HTTP, validation, chat template, tokenizer, both IPC hops,
  detokenizer, response — is the server's.
- with `--model DIR` (the server's model), a cross-check that needs no header: each HTTP request
  is paired with the same token ids run right after it in this process, on `Engine` (core
  process, IPC, detokenizer) and on the bare engine core; medians of the per-request differences
  give the overhead again and split it into the HTTP layer (HTTP − `Engine`) and the engine's IPC
  and front end (`Engine` − core). Two processes running the same model see the machine
  differently, so this is noisier than the header.
It also prints the CPU time the server's HTTP process spent per request (from its
`process_cpu_seconds_total`: HTTP, validation, chat template, tokenizer, IPC, detokenizer), which
a busy machine does not distort the way it distorts latencies.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import random
import statistics
import time
import urllib.parse
from dataclasses import dataclass, field

import httpx

_CORPUS = ("the of and to in is was for on that with as by at from his her they this be are "
           "an which or had not but what all were when we there can been has more if will one "
           "time about would out into so some could them other than then now only its also "
           "river mountain city winter summer garden music paper window story market engine "
           "signal harbor forest number silver bridge letter planet ocean kitchen doctor")
WORDS = tuple(_CORPUS.split())
WARMUP = 5


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    error: str = ""


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Client:
    def __init__(self, args: argparse.Namespace) -> None:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.http = httpx.AsyncClient(base_url=args.base_url.rstrip("/").removesuffix("/v1"),
                                      headers=headers, timeout=httpx.Timeout(600.0),
                                      limits=httpx.Limits(max_connections=1024))
        self.args = args
        self.model = args.model_name

    async def resolve_model(self) -> None:
        if self.model is None:
            r = await self.http.get("/v1/models")
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]

    async def request(self, messages: list[dict]) -> Result:
        a = self.args
        body: dict = {"model": self.model, "max_tokens": a.output_len, "stream": True,
                      "stream_options": {"include_usage": True}, "temperature": a.temperature}
        if a.ignore_eos:
            body["ignore_eos"] = True
        if a.endpoint == "chat":
            path, body["messages"] = "/v1/chat/completions", messages
        else:
            path = "/v1/completions"
            body["prompt"] = "\n".join(m["content"] for m in messages)
        res = Result(ok=False)
        start = last = time.perf_counter()
        parts: list[str] = []
        try:
            async with self.http.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return res
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        res.error = str(event["error"])
                        return res
                    if event.get("usage"):
                        usage = event["usage"]
                        res.prompt_tokens = usage["prompt_tokens"]
                        res.output_tokens = usage["completion_tokens"]
                        details = usage.get("prompt_tokens_details") or {}
                        res.cached_tokens = details.get("cached_tokens") or 0
                    for choice in event.get("choices", ()):
                        piece = (choice.get("delta", {}).get("content")
                                 if a.endpoint == "chat" else choice.get("text"))
                        if piece:
                            now = time.perf_counter()
                            if not parts:
                                res.ttft = now - start
                            else:
                                res.itl.append(now - last)
                            last = now
                            parts.append(piece)
        except httpx.HTTPError as exc:
            res.error = f"{type(exc).__name__}: {exc}"
            return res
        res.latency = time.perf_counter() - start
        res.text = "".join(parts)
        res.ok = True
        return res


def conversations(args: argparse.Namespace) -> list[list[list[dict]]]:
    """Per conversation, the first user message of each turn (history is added as it runs)."""
    rng = random.Random(args.seed)
    if args.workload == "random":
        return [[[{"role": "user", "content": words(rng, args.input_len)}]]
                for _ in range(args.num_requests)]
    if args.workload == "shared-prefix":
        prefixes = [words(rng, args.shared_prefix_len) for _ in range(args.num_prefixes)]
        return [[[{"role": "system", "content": rng.choice(prefixes)},
                  {"role": "user", "content": words(rng, args.input_len)}]]
                for _ in range(args.num_requests)]
    count = max(1, args.num_requests // args.turns)
    return [[[{"role": "user", "content": words(rng, args.input_len)}] for _ in range(args.turns)]
            for _ in range(count)]


async def run_conversation(client: Client, turns: list[list[dict]], results: list[Result],
                           sem: asyncio.Semaphore | None) -> None:
    history: list[dict] = []
    for turn in turns:
        history = history + turn
        if sem is None:
            res = await client.request(history)
        else:
            async with sem:
                res = await client.request(history)
        results.append(res)
        if not res.ok:
            return
        history = [*history, {"role": "assistant", "content": res.text}]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def report(args: argparse.Namespace, results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    out = sum(r.output_tokens for r in ok)
    itl = [x for r in ok for x in r.itl]
    summary = {
        "workload": args.workload, "endpoint": args.endpoint,
        "mode": (f"closed-loop x{args.concurrency}" if args.concurrency
                 else f"poisson {args.request_rate} req/s"),
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_tokens_per_s": out / duration,
        "total_tokens_per_s": (prompt + out) / duration,
        "prompt_tokens": prompt, "cached_tokens": cached, "output_tokens": out,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
    }
    for name, values in (("ttft", [r.ttft for r in ok]), ("itl", itl),
                         ("latency", [r.latency for r in ok])):
        for q in (50, 90, 99):
            summary[f"{name}_p{q}_ms"] = pct(values, q) * 1000
    return summary


def print_summary(summary: dict, errors: list[str]) -> None:
    width = max(map(len, summary))
    for key, value in summary.items():
        shown = f"{value:.3f}" if isinstance(value, float) else value
        print(f"{key:<{width}}  {shown}")
    for error in errors[:5]:
        print(f"error: {error}")


async def run(args: argparse.Namespace) -> dict:
    client = Client(args)
    await client.resolve_model()
    convs = conversations(args)
    results: list[Result] = []
    rng = random.Random(args.seed + 1)
    start = time.perf_counter()
    if args.concurrency:
        sem = asyncio.Semaphore(args.concurrency)
        await asyncio.gather(*(run_conversation(client, c, results, sem) for c in convs))
    else:
        tasks = []
        for conv in convs:
            tasks.append(asyncio.create_task(run_conversation(client, conv, results, None)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    await client.http.aclose()
    summary = report(args, results, duration)
    print_summary(summary, [r.error for r in results if not r.ok])
    return summary


def overhead_messages(count: int, words_per_prompt: int, seed: int | None) -> list[list[dict]]:
    rng = random.Random(seed)   # a fresh seed per run: a second run must not hit the cache
    return [[{"role": "user", "content": words(rng, words_per_prompt)}] for _ in range(count)]


class LeanClient:
    """Sequential requests on one keep-alive connection with the standard library's client: it
    costs ~0.3 ms less per request than httpx here, and that time is not the server's."""

    def __init__(self, args: argparse.Namespace) -> None:
        url = urllib.parse.urlsplit(args.base_url)
        self.conn = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=600)
        self.headers = {"Content-Type": "application/json"}
        self.engine_seconds: float | None = None   # from the last response's Server-Timing
        if args.api_key:
            self.headers["Authorization"] = f"Bearer {args.api_key}"

    def call(self, method: str, path: str, body: dict | None = None) -> bytes:
        # bytes, not str: http.client then sends headers and body in one segment
        self.conn.request(method, path, json.dumps(body).encode() if body is not None else None,
                          self.headers)
        response = self.conn.getresponse()
        data = response.read()
        self.engine_seconds = engine_seconds(response.getheader("Server-Timing"))
        if response.status != 200:
            raise RuntimeError(f"{method} {path}: HTTP {response.status}: {data[:200]!r}")
        return data

    def cpu_seconds(self) -> float | None:
        """CPU time of the server's HTTP process (`process_cpu_seconds_total`), if exported."""
        for line in self.call("GET", "/metrics").decode().splitlines():
            if line.startswith("process_cpu_seconds_total "):
                return float(line.split()[1])
        return None


def engine_seconds(server_timing: str | None) -> float | None:
    """`engine;dur=MS` out of a Server-Timing header, in seconds."""
    for metric in (server_timing or "").split(","):
        name, *params = (part.strip() for part in metric.split(";"))
        if name == "engine":
            for param in params:
                if param.startswith("dur="):
                    return float(param[4:]) / 1000
    return None


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


class InProcessEngines:
    """The same one-token request on the engine API (`Engine.generate_async`: core process, IPC,
    detokenizer) and on the bare engine core (scheduler, forward, sampling), in this process."""

    def __init__(self, model: str, kv_tokens: int) -> None:
        from radixpool.worker import Engine
        from radixpool.worker.config import EngineConfig
        from radixpool.worker.engine_core import EngineCore
        from radixpool.worker.sampling_params import SamplingParams

        self.engine = Engine(model, device="cpu", kv_cache_tokens=kv_tokens)
        self.core = EngineCore(EngineConfig(model_path=model, device="cpu",
                                            kv_cache_tokens=kv_tokens))
        self.params = SamplingParams(max_new_tokens=1, temperature=0)
        self.loop = asyncio.new_event_loop()
        self.engine.bind_loop(self.loop)   # as the server does: output read on the loop
        self.count = 0

    def api(self, ids: list[int]) -> None:
        self.loop.run_until_complete(self.engine.generate_async(
            input_ids=ids, sampling_params=self.params))

    def bare_core(self, ids: list[int]) -> None:
        from radixpool.worker.messages import GenerateRequest

        self.count += 1
        self.core.add_request(GenerateRequest(f"r{self.count}", ids, self.params, seed=0))
        while self.core.has_work:
            self.core.step()

    def close(self) -> None:
        self.engine.shutdown()
        self.loop.close()


def overhead(args: argparse.Namespace) -> dict:
    """Sequential one-token chat requests (so the chat template and tokenizer count). With
    `--model`, each HTTP request is paired with the same token ids on the in-process engine API
    and engine core, one right after the other, so all three see the same machine conditions;
    the overhead is the median of the per-request differences."""
    client = LeanClient(args)
    model = args.model_name or json.loads(client.call("GET", "/v1/models"))["data"][0]["id"]
    conversations = overhead_messages(args.requests + WARMUP, args.prompt_words, args.seed)
    health = [timed(client.call, "GET", "/health") for _ in range(args.requests)]
    local = None
    if args.model:
        from radixpool.tokenization import PromptTokenizer

        kv_tokens = json.loads(client.call("GET", "/server_info"))["kv_capacity_tokens"]
        local = InProcessEngines(args.model, kv_tokens)   # same KV size: they evict alike
        tokenizer = PromptTokenizer.from_dir(args.model)
    cpu_before = client.cpu_seconds()
    http_times, engine_times, api_times, core_times = [], [], [], []
    for messages in conversations:
        http_times.append(timed(client.call, "POST", "/v1/chat/completions", {
            "model": model, "messages": messages, "max_tokens": 1, "temperature": 0}))
        engine_times.append(client.engine_seconds)
        if local is not None:
            ids = tokenizer.encode_chat(messages)
            api_times.append(timed(local.api, ids))
            core_times.append(timed(local.bare_core, ids))
    cpu_after = client.cpu_seconds()
    http_times, engine_times = http_times[WARMUP:], engine_times[WARMUP:]
    summary = {"requests": len(http_times),
               "health_round_trip_p50_ms": statistics.median(health) * 1000,
               "http_p50_ms": statistics.median(http_times) * 1000,
               "http_p90_ms": pct(http_times, 90) * 1000}
    if None not in engine_times:   # the server reports each request's time in its engine core
        summary["engine_core_reported_p50_ms"] = statistics.median(engine_times) * 1000
        overheads = [h - e for h, e in zip(http_times, engine_times, strict=True)]
        summary["server_overhead_p50_ms"] = statistics.median(overheads) * 1000
        summary["server_overhead_p90_ms"] = pct(overheads, 90) * 1000
    if cpu_before is not None and cpu_after is not None:   # the server idles between requests
        summary["server_cpu_ms_per_request"] = ((cpu_after - cpu_before) * 1000
                                                / len(conversations))
    if local is not None:
        local.close()
        api_times, core_times = api_times[WARMUP:], core_times[WARMUP:]
        summary["paired_engine_api_p50_ms"] = statistics.median(api_times) * 1000
        summary["paired_engine_core_p50_ms"] = statistics.median(core_times) * 1000
        pairs = list(zip(http_times, api_times, core_times, strict=True))
        summary["paired_server_overhead_p50_ms"] = statistics.median(
            h - c for h, _, c in pairs) * 1000
        summary["paired_of_which_http_layer_ms"] = statistics.median(
            h - a for h, a, _ in pairs) * 1000
        summary["paired_of_which_ipc_front_end_ms"] = statistics.median(
            a - c for _, a, c in pairs) * 1000
    print_summary(summary, [])
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="server root or its /v1 URL")
    common.add_argument("--api-key", help="sent as `Authorization: Bearer KEY`")
    common.add_argument("--model-name",
                        help="`model` to request (default: the first of /v1/models)")
    common.add_argument("--json", metavar="FILE", help="also write the summary as JSON")
    r = sub.add_parser("run", parents=[common], help="run a workload and print latency stats")
    r.add_argument("--workload", choices=("random", "shared-prefix", "multi-turn"),
                   default="shared-prefix")
    r.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    r.add_argument("--num-requests", type=int, default=100)
    mode = r.add_mutually_exclusive_group()
    mode.add_argument("--request-rate", type=float, default=float("inf"),
                      help="Poisson arrival rate in requests/s (default: all at once)")
    mode.add_argument("--concurrency", type=int, help="closed loop: this many requests in flight")
    r.add_argument("--input-len", type=int, default=64, help="words per user message")
    r.add_argument("--output-len", type=int, default=32, help="max_tokens per request")
    r.add_argument("--shared-prefix-len", type=int, default=512,
                   help="words in each shared system prompt (shared-prefix)")
    r.add_argument("--num-prefixes", type=int, default=4, help="distinct shared system prompts")
    r.add_argument("--turns", type=int, default=4, help="turns per conversation (multi-turn)")
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--ignore-eos", action="store_true",
                   help="send `ignore_eos` (a RadixPool/SGLang/vLLM extension)")
    r.add_argument("--seed", type=int, default=0)
    o = sub.add_parser("overhead", parents=[common],
                       help="server overhead per request: HTTP latency minus engine-core time")
    o.add_argument("--model", metavar="DIR",
                   help="the server's model directory, to time the engine core in-process")
    o.add_argument("--requests", type=int, default=200)
    o.add_argument("--prompt-words", type=int, default=12, help="words per chat message")
    o.add_argument("--seed", type=int, help="prompt seed (default: new prompts every run)")
    args = parser.parse_args()
    summary = asyncio.run(run(args)) if args.command == "run" else overhead(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
