"""The worker as users run it, on a GPU: `radixpool worker` (its HTTP process and its engine core
process) serving a Qwen3-0.6B-shaped model (random weights, the tiny model's tokenizer), called
with the official `openai` SDK, then its engine core stopped under a live stream for the
watchdog to find.

    python bench/gpu_server.py                  # on a GPU: FlashInfer and CUDA graphs (auto)
    python bench/gpu_server.py --device cpu     # the same on CPU, the model scaled down

The other GPU checks drive `EngineCore` in-process (tests, `gpu_soak.py`, `gpu.py`); this one
runs the server's own process layout, so what only shows there does: the core started in a fresh
interpreter on the device, the warm-up before ready, the heartbeat the watchdog reads, the
OpenAI routes' streaming and structured output over real HTTP; last, on a GPU, a second start
asking for twice the KV pool the first sized must be refused at once. Each check prints one
line, PASS or FAIL with what it saw; the exit status is the number of failures. Figures it
prints (start, ready, the shared-prefix batch's time and hit rate) are one run's, not a
benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file

from bench.gpu import TINY  # the scaled-down shape of the other GPU benches
from radixpool.protocol.metrics import CACHED_PROMPT_TOKENS

WATCHDOG_S = 5
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}}}


def write_model(directory: Path, *, scaled_down: bool) -> Path:
    """A Qwen3-0.6B configuration (head dim 128, bf16) with the tiny model's tokenizer and chat
    template; its vocabulary is the tokenizer's, so every sampled id is text."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench.soak_mix import write_tokenizer
    from radixpool.worker.model.reference_configs import write_reference_config
    from radixpool.worker.tiny_model import CHAT_TEMPLATE

    directory.mkdir(parents=True)
    vocab = write_tokenizer(directory, chat_template=CHAT_TEMPLATE)
    overrides = dict(vocab_size=vocab, bos_token_id=1, eos_token_id=2)
    if scaled_down:
        overrides = {**TINY, **overrides, "head_dim": 64}
    write_reference_config(directory, "qwen3-0.6b", **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory),
                                             dtype=torch.bfloat16)
    model.save_pretrained(directory)
    return directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


class Checks:
    def __init__(self) -> None:
        self.failed = 0

    def check(self, name: str, ok: bool, detail: str) -> bool:
        self.failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        return ok


def wait_ready(base: str, proc: subprocess.Popen, limit: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.5)
    return None


def metric_sum(base: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == name)


def serving_checks(c: Checks, client, base: str, model: str) -> None:
    import jsonschema

    r = client.chat.completions.create(model=model, max_tokens=16,
                                       messages=[{"role": "user", "content": "Hello there"}])
    c.check("chat", r.choices[0].finish_reason in ("stop", "length")
            and r.usage.completion_tokens > 0,
            f"finish {r.choices[0].finish_reason}, usage {r.usage.prompt_tokens} in / "
            f"{r.usage.completion_tokens} out")

    chunks, text, usage = 0, "", None
    for chunk in client.chat.completions.create(
            model=model, max_tokens=24, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "Tell me a story"}]):
        chunks += 1
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    c.check("chat stream", usage is not None and usage.completion_tokens > 0 and chunks > 2,
            f"{chunks} chunks, {len(text)} characters, usage "
            f"{usage.completion_tokens if usage else None} tokens")

    complete, valid = 0, 0
    for i in range(4):
        r = client.chat.completions.create(
            model=model, max_tokens=256, seed=i,
            messages=[{"role": "user", "content": "A person as JSON"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": SCHEMA}})
        if r.choices[0].finish_reason != "stop":   # cut by max_tokens: incomplete, not wrong
            continue
        complete += 1
        try:
            jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            print(f"  output {r.choices[0].message.content!r}: {exc}", flush=True)
    c.check("json_schema", complete > 0 and valid == complete,
            f"{valid} of {complete} complete outputs valid ({4 - complete} cut by length)")

    r = client.completions.create(model=model, prompt="The capital of", max_tokens=8, n=2,
                                  logprobs=3, temperature=0.8, seed=7)
    tops = [len(t) for choice in r.choices for t in choice.logprobs.top_logprobs]
    c.check("n=2 logprobs", len(r.choices) == 2 and tops and min(tops) >= 3,
            f"{len(r.choices)} choices, top logprobs per step {min(tops, default=0)}+")


async def shared_prefix(client, model: str, requests: int) -> tuple[float, int, int, int]:
    system = " ".join(f"rule {i}: answer briefly and cite section {i * 7}." for i in range(120))

    async def one(i: int):
        return await client.chat.completions.create(
            model=model, max_tokens=32, extra_body={"ignore_eos": True},
            messages=[{"role": "system", "content": system},
                      {"role": "user", "content": f"Question {i}: what does rule {i} say?"}])

    t0 = time.monotonic()
    done = await asyncio.gather(*(one(i) for i in range(requests)))
    seconds = time.monotonic() - t0
    prompt = sum(r.usage.prompt_tokens for r in done)
    cached = sum((r.usage.prompt_tokens_details.cached_tokens or 0)
                 if r.usage.prompt_tokens_details else 0 for r in done)
    return seconds, prompt, cached, sum(r.usage.completion_tokens for r in done)


def watchdog_check(c: Checks, client, proc: subprocess.Popen, model: str) -> None:
    """Stop the engine core mid-stream: the watchdog must kill it, the stream end in an error,
    and the worker exit 1 (its pod restarts)."""
    import openai

    cores = children(proc.pid)
    if not c.check("one engine core", len(cores) == 1, f"children of the worker: {cores}"):
        return
    stream = client.chat.completions.create(
        model=model, max_tokens=4000, stream=True, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "Go on forever"}])
    outcome, tokens, stopped_at = "ended normally", 0, None
    try:
        for _ in stream:
            tokens += 1
            if tokens == 4:
                os.kill(cores[0], signal.SIGSTOP)
                stopped_at = time.monotonic()
    except (openai.APIError, OSError) as exc:   # the SDK raises an error event as APIError
        outcome = f"error after {tokens} chunks: {str(exc)[:160]}"
    ended = time.monotonic() - stopped_at if stopped_at else None
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        code = None
    c.check("watchdog", stopped_at is not None and outcome.startswith("error")
            and ended is not None and ended < 4 * WATCHDOG_S and code == 1,
            f"core stopped after 4 chunks; stream {outcome}; "
            f"{ended if ended is None else round(ended, 1)} s after the stop; "
            f"worker exit code {code}")


def oversized_kv_check(c: Checks, cmd: list[str], worker_log: Path, log_path: Path) -> None:
    """A worker asked for twice the KV pool the first one sized for itself must refuse at
    start, naming the largest pool that leaves a step room, not fail mid-serving."""
    import re

    sized = re.search(r"KV capacity (\d+) tokens", worker_log.read_text(errors="replace"))
    if not c.check("oversized kv_cache_tokens: first pool's size", sized is not None,
                   "read from the first worker's log"):
        return
    tokens = 2 * int(sized.group(1))
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd + ["--kv-cache-tokens", str(tokens)], stdout=log,
                              stderr=subprocess.STDOUT, timeout=240)
    said = [line for line in log_path.read_text(errors="replace").splitlines()
            if "set --kv-cache-tokens to at most" in line]
    c.check("oversized kv_cache_tokens", proc.returncode != 0 and bool(said),
            f"--kv-cache-tokens {tokens}: exit code {proc.returncode}; "
            f"{said[-1][-220:] if said else 'no refusal naming the largest pool that fits'}")


def main() -> int:
    import openai
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--requests", type=int, default=64, help="shared-prefix batch size")
    p.add_argument("--ready-timeout", type=float, default=300)
    p.add_argument("--log", help="worker log file (default: a temporary file)")
    args = p.parse_args()
    c = Checks()
    work = Path(tempfile.mkdtemp(prefix="gpu-server-"))
    t0 = time.monotonic()
    model_dir = write_model(work / "model", scaled_down=args.device == "cpu")
    print(f"model written in {time.monotonic() - t0:.1f} s", flush=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = Path(args.log or work / "worker.log")
    cmd = [sys.executable, "-m", "radixpool.cli", "worker", "--model", str(model_dir),
           "--device", args.device, "--port", str(port), "--served-model-name", "m",
           "--watchdog-timeout", str(WATCHDOG_S)]
    if args.device == "cpu":
        cmd += ["--kv-cache-tokens", "65536"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        ready = wait_ready(base, proc, args.ready_timeout)
        if not c.check("ready", ready is not None, f"in {ready and round(ready, 1)} s "
                       f"(weights, KV pool, graphs, warm-up; exit code {proc.poll()})"):
            return c.failed
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0,
                               timeout=120)
        serving_checks(c, client, base, "m")
        aclient = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0,
                                     timeout=300)
        seconds, prompt, cached, out = asyncio.run(shared_prefix(aclient, "m", args.requests))
        c.check("shared prefix", cached > prompt / 2,
                f"{args.requests} concurrent requests in {seconds:.2f} s, "
                f"{out / seconds:.0f} output tokens/s, cached {cached} of {prompt} prompt "
                f"tokens ({cached / prompt:.0%})")
        cached_metric = metric_sum(base, CACHED_PROMPT_TOKENS.name)
        c.check("metrics", cached_metric >= cached,
                f"{CACHED_PROMPT_TOKENS.name} {cached_metric:.0f} >= usage's {cached}")
        watchdog_check(c, client, proc, "m")
        if args.device == "cuda":   # a CPU pool given outright is not checked against memory
            oversized_kv_check(c, cmd, log_path, log_path.with_name("worker-oversized.log"))
    finally:
        if proc.poll() is None:
            for core in children(proc.pid):
                os.kill(core, signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        lines = log_path.read_text(errors="replace").splitlines()
        picked = [line for line in lines if any(k in line for k in (
            "attention", "graph", "warm-up", "ready", "watchdog", "made no progress",
            "Traceback", "Error"))]
        print("worker log (selected lines):", *picked[-20:], sep="\n  ")
    print(f"{c.failed} failed", flush=True)
    return c.failed


if __name__ == "__main__":
    sys.exit(main())
