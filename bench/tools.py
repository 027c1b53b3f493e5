"""Agent-loop benchmark: tool-calling agents through a real gateway in front of real workers.

    python bench/tools.py                                  # 2 workers, 8 agents x 5 turns
    python bench/tools.py --workers 3 --agents 12 --turns 6 --policies cache_aware round_robin

Each agent keeps one conversation: a fixed system prompt and tool list (the same for every
agent, as in a deployed agent), its own task, then turns of `tool_choice="required"` calls
answered by `tool` messages. Every turn resends the whole history, so a worker that served the
previous turn holds all but the newest call and result in its radix cache. Per routing policy
(the workers' caches are flushed between policies) this prints the fleet hit rate (cached /
prompt tokens, as the workers reported them in `usage`), the share of calls whose arguments
validate against their schema, and wall time. Workers are `radixpool worker` processes with the
tiny model on CPU; the agents run on threads with the official `openai` SDK.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
from openai import OpenAI

TOOLS = [
    {"type": "function", "function": {
        "name": name, "description": f"{name.replace('_', ' ')} for the agent",
        "parameters": {"type": "object", "additionalProperties": False,
                       "required": list(props), "properties": props}}}
    for name, props in [
        ("search_docs", {"query": {"type": "string", "enum": ["cache", "radix", "gateway"]},
                         "limit": {"type": "integer", "minimum": 1, "maximum": 9}}),
        ("read_file", {"path": {"type": "string", "enum": ["a.py", "b.py", "README.md"]}}),
        ("run_tests", {"target": {"type": "string", "enum": ["unit", "e2e"]},
                       "verbose": {"type": "boolean"}}),
        ("write_note", {"topic": {"type": "string", "enum": ["plan", "result"]},
                        "priority": {"type": "integer", "minimum": 0, "maximum": 3}}),
    ]]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SYSTEM = ("You are a careful engineering agent. Use the tools to gather facts before you answer. "
          * 2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, path: str, proc: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become ready")


def spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "radixpool.cli", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def agent(client: OpenAI, index: int, turns: int) -> tuple[int, int, int, int]:
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Task {index}: find why job {index * 7919} fails "
                                            f"and write down what you learn. "}]
    prompt = cached = calls = valid = 0
    for turn in range(turns):
        reply = client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=index * 100 + turn)
        prompt += reply.usage.prompt_tokens
        cached += reply.usage.prompt_tokens_details.cached_tokens
        message = reply.choices[0].message
        if reply.choices[0].finish_reason == "length" and message.tool_calls:
            # the last call was cut off (its arguments so far): an agent asks again instead
            message.tool_calls = message.tool_calls[:-1] or None
            message.content = message.content or ""
        for call in message.tool_calls or []:
            calls += 1
            try:
                jsonschema.validate(json.loads(call.function.arguments),
                                    SCHEMAS[call.function.name])
                valid += 1
            except (ValueError, KeyError, jsonschema.ValidationError):
                pass
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": json.dumps({"ok": True, "turn": turn, "agent": index,
                                                    "log": [f"line {index}-{turn}-{k}"
                                                            for k in range(2)]})})
    return prompt, cached, calls, valid


def warm_up(urls: list[str]) -> None:
    """One tool request per worker, so grammar compiles are not in the first policy's time."""
    for url in urls:
        OpenAI(base_url=url + "/v1", api_key="unused").chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
            tool_choice="required", parallel_tool_calls=False, max_tokens=80)


def run_policy(policy: str, urls: list[str], args: argparse.Namespace) -> str:
    for url in urls:
        httpx.post(url + "/flush_cache", timeout=30).raise_for_status()
    port = free_port()
    gateway = spawn(["gateway", "--worker-urls", *urls, "--host", "127.0.0.1", "--port",
                     str(port), "--policy", policy, "--log-level", "warning"])
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, "/health", gateway)
        for _ in range(100):   # route on tokens, like production, before measuring
            if httpx.get(base + "/workers", timeout=1).json().get("routing_on") == "tokens":
                break
            time.sleep(0.1)
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(lambda i: agent(client, i, args.turns), range(args.agents)))
        wall = time.perf_counter() - start
    finally:
        gateway.terminate()
        gateway.wait(30)
    prompt, cached, calls, valid = (sum(r[k] for r in results) for k in range(4))
    return (f"{policy:<12} {len(urls):>3} {args.agents:>6} {args.turns:>5} {prompt:>8} "
            f"{cached / prompt:8.3f} {valid}/{calls:<6} {wall:7.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    p.add_argument("--jump-forward", default="exact", choices=["exact", "retokenize", "off"],
                   help="the workers' --jump-forward (retokenize: calls in the tokenizer's split)")
    args = p.parse_args()
    if args.model is None:
        from radixpool.worker.tiny_model import default_tiny_model

        args.model = str(default_tiny_model())
    ports = [free_port() for _ in range(args.workers)]
    workers = [spawn(["worker", "--model", args.model, "--served-model-name", "tiny",
                      "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                      "--kv-cache-tokens", "32768", "--log-level", "warning",
                      "--jump-forward", args.jump_forward])
               for port in ports]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        for url, proc in zip(urls, workers):
            wait_ready(url, "/health", proc)
        warm_up(urls)
        print("policy       workers agents turns   prompt  hitrate valid/calls  wall_s")
        for policy in args.policies:
            print(run_policy(policy, urls, args), flush=True)
    finally:
        for proc in workers:
            proc.terminate()
        for proc in workers:
            proc.wait(60)


if __name__ == "__main__":
    main()
