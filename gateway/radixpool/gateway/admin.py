"""Admin endpoints: `GET /workers` (what the gateway knows and believes about each worker),
`POST /workers {"url": ...}` and `DELETE /workers?url=...` (static mode only; with Kubernetes
discovery the EndpointSlices own membership; who may call them is `access.py`'s business), and
the gateway's own `/health` document. They see the gateway only through its `WorkerSet`.

`GET /workers` puts the routing-quality numbers side by side: per worker and for the fleet, the
prompt tokens answered, the cached tokens the workers reported (`actual_hit_rate`) and the cached
tokens the trees predicted (`predicted_hit_rate`), plus how often the trees were corrected. A row
is a worker in the fleet now, since it joined; the fleet's totals are since the gateway started,
removed workers included (as `radixpool_gateway_hit_rate{worker="all"}`), so a rollout does not
reset them: they are not the sum of the rows.
"""

from __future__ import annotations

import json
from urllib.parse import parse_qs

from radixpool.gateway.http_edge import (
    Headers,
    Request,
    error_body,
    json_body,
    method_not_allowed,
)
from radixpool.gateway.metrics import TokenTotals
from radixpool.gateway.workers import Worker, WorkerSet


def health_body(eligible: int, total: int, draining: bool = False
                ) -> tuple[int, Headers, bytes]:
    status = "draining" if draining else "ok" if eligible else "no_healthy_workers"
    return json_body(200 if eligible and not draining else 503,
                     {"status": status, "eligible_workers": eligible, "workers": total})


def _rate(part: int, whole: int) -> float:
    return round(part / whole, 4) if whole else 0.0


def describe(fleet: WorkerSet, worker: Worker, now: float) -> dict:
    info = worker.info
    return {
        "url": worker.url,
        "pod": worker.pod,
        "eligible": worker.eligible(now),
        "healthy": worker.health.healthy,
        "draining": worker.draining,
        "health_failure": worker.health_failure,
        "terminating": worker.terminating,
        "circuit_breaker": worker.breaker.state(now),
        "breaker_failures": dict(worker.breaker.failures_by_kind),
        "inflight": worker.inflight,
        # requests it holds, all gateways', as its KV-event stream says (null: not said)
        "reported_load": worker.reported_load,
        "instance_id": worker.instance_id,
        "model": worker.model,
        "kv_capacity_tokens": info.kv_capacity_tokens if info else None,
        # what routing assumes of it: reuse-aware eviction gives it room, lpm gets hits at once
        "eviction_policy": info.eviction_policy if info else None,
        "schedule_policy": info.schedule_policy if info else None,
        "tree_blocks": fleet.index.size(worker.url),
        "tree_capacity_blocks": fleet.index.capacity(worker.url),
        "requests": worker.requests,
        "prompt_tokens": worker.prompt_tokens,
        "cached_tokens": worker.cached_tokens,
        "predicted_cached_tokens": worker.predicted_tokens,
        "actual_hit_rate": _rate(worker.cached_tokens, worker.prompt_tokens),
        "predicted_hit_rate": _rate(worker.predicted_tokens, worker.prompt_tokens),
        "tree_corrections": dict(worker.corrections),
        "tree_source": worker.tree_source,
        "unreported_answers": worker.unreported_answers,
    }


def workers_document(fleet: WorkerSet, totals: TokenTotals, now: float) -> dict:
    return {
        "policy": fleet.config.policy,
        "routing_on": "tokens" if fleet.keys.tokenizer is not None else "text",
        "fleet": {
            "prompt_tokens": totals.prompt,
            "cached_tokens": totals.cached,
            "predicted_cached_tokens": totals.predicted,
            "actual_hit_rate": _rate(totals.cached, totals.prompt),
            "predicted_hit_rate": _rate(totals.predicted, totals.prompt),
        },
        "workers": [describe(fleet, w, now) for w in fleet],
    }


def workers_endpoint(fleet: WorkerSet, totals: TokenTotals, request: Request, now: float
                     ) -> tuple[int, Headers, bytes]:
    """`totals`: the fleet's since the gateway started (`GatewayMetrics.fleet`)."""
    if request.method in ("GET", "HEAD"):   # (the edge sends no body to a HEAD)
        return json_body(200, workers_document(fleet, totals, now))
    if request.method not in ("POST", "DELETE"):
        return method_not_allowed(f"/workers accepts GET, POST and DELETE, not "
                                  f"{request.method}", "GET, HEAD, POST, DELETE")
    if not fleet.config.static_mode:
        return error_body(409, "workers come from Kubernetes discovery (--k8s-service); "
                               "add or remove them there")
    url = _target_url(request)
    if url is None:
        return error_body(400, "give the worker as {\"url\": \"http://HOST:PORT\"} or ?url=")
    try:
        if request.method == "POST":
            worker = fleet.add(url)
            return json_body(200, describe(fleet, worker, now))
        removed = fleet.remove(url)
    except ValueError as exc:
        return error_body(400, str(exc))
    if removed is None:
        return error_body(404, f"no worker {url!r}")
    return json_body(200, {"removed": removed.url, "inflight_finishing": removed.inflight})


def _target_url(request: Request) -> str | None:
    query = parse_qs(request.query).get("url")
    if query:
        return query[0]
    if request.body:
        try:
            doc = json.loads(request.body)
        except (ValueError, RecursionError):
            return None
        if isinstance(doc, dict) and isinstance(doc.get("url"), str):
            return doc["url"]
    return None
