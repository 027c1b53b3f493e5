"""A streaming chat client that measures what a user feels: time to first token, and the
worker's own account of the prompt (`usage.prompt_tokens_details.cached_tokens`).

Plain httpx (a base dependency) rather than the openai SDK (a dev extra), so `radixpool demo`
works on a gateway-only install.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

WORKER_HEADER = "x-radixpool-worker"


@dataclass(frozen=True)
class ChatResult:
    ok: bool
    seconds: float
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""
    worker: str | None = None
    error: str | None = None


def stream_chat(http: httpx.Client, model: str, messages: list[dict], max_tokens: int
                ) -> ChatResult:
    """POST /v1/chat/completions with `stream: true` and usage; never raises for HTTP trouble."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    ttft = None
    parts: list[str] = []
    usage: dict = {}
    worker = None
    try:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            worker = response.headers.get(WORKER_HEADER)
            if response.status_code != 200:
                detail = response.read().decode(errors="replace")[:300]
                return ChatResult(False, time.perf_counter() - started, worker=worker,
                                  error=f"HTTP {response.status_code}: {detail}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return ChatResult(False, time.perf_counter() - started, ttft, worker=worker,
                                      error=str(event["error"].get("message", event["error"])))
                for choice in event.get("choices", ()):
                    text = choice.get("delta", {}).get("content")
                    if ttft is None and (text or choice.get("finish_reason")):
                        ttft = time.perf_counter() - started
                    if text:
                        parts.append(text)
                usage = event.get("usage") or usage
    except (httpx.HTTPError, ValueError) as exc:
        return ChatResult(False, time.perf_counter() - started, ttft, worker=worker,
                          error=f"{type(exc).__name__}: {exc}")
    details = usage.get("prompt_tokens_details") or {}
    return ChatResult(True, time.perf_counter() - started, ttft, usage.get("prompt_tokens", 0),
                      details.get("cached_tokens", 0), usage.get("completion_tokens", 0),
                      "".join(parts), worker)
