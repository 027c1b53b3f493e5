"""Dashboards query only series the worker and gateway export, and the chart ships the same."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from radixpool.operator.dashboards import DASHBOARD_DIRS, dashboard_files
from radixpool.protocol.metrics import ALL_METRICS

REPO = Path(__file__).resolve().parents[1]
EXPORTED = {series for spec in ALL_METRICS for series in spec.series}
LABELS = {label for spec in ALL_METRICS for label in spec.labels} | {
    "le", "pod", "namespace", "instance", "job", "radixpool_io_pool",
    "app_kubernetes_io_component"}
PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "rate", "irate", "increase", "histogram_quantile",
    "by", "without", "on", "ignoring", "label_values", "topk", "bottomk", "clamp_min",
}


def series_in(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, grouping labels) a PromQL expression uses."""
    grouped = set()
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        grouped |= {label.strip() for label in group.split(",") if label.strip()}
    stripped = re.sub(r"\b(?:by|without)\s*\([^)]*\)", " ", expr)
    stripped = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"|\$\w+", " ", stripped)
    if stripped.startswith("label_values("):  # label_values(metric, label)
        stripped = stripped.rsplit(",", 1)[0]
    names = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", stripped)) - PROMQL_WORDS
    return names, grouped


def queries(board: dict) -> list[str]:
    found = [t["expr"] for panel in board["panels"] for t in panel.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            found.append(variable["query"]["query"])
    return found


def boards() -> dict[str, dict]:
    return {name: json.loads((REPO / "dashboards" / name).read_text())
            for name in dashboard_files()}


def test_dashboard_files_in_repo_and_chart_are_current():
    for folder in DASHBOARD_DIRS:
        for name, text in dashboard_files().items():
            path = REPO / folder / name
            assert path.exists() and path.read_text() == text, (
                f"{path} is stale: run `python -m radixpool.operator.dashboards`")


@pytest.mark.parametrize("name", sorted(dashboard_files()))
def test_every_query_names_only_exported_series_and_labels(name):
    board = boards()[name]
    exprs = queries(board)
    assert len(exprs) >= 10
    for expr in exprs:
        names, grouped = series_in(expr)
        assert names, f"no metric in {expr!r}"
        assert names <= EXPORTED, f"{name}: {sorted(names - EXPORTED)} not exported ({expr})"
        assert grouped <= LABELS, f"{name}: unknown labels {sorted(grouped - LABELS)} ({expr})"


def test_the_checker_catches_a_metric_nobody_exports():
    names, _ = series_in('sum(rate(radixpool_made_up_total{pod="x"}[5m])) / up')
    assert names - EXPORTED == {"radixpool_made_up_total", "up"}


def test_fleet_view_covers_what_operators_watch():
    fleet = " ".join(queries(boards()["radixpool-fleet.json"]))
    titles = " ".join(p["title"] for p in boards()["radixpool-fleet.json"]["panels"]).lower()
    for needed in ("radixpool_time_to_first_token_seconds_bucket",
                   "radixpool_inter_token_latency_seconds_bucket",
                   "radixpool_gateway_predicted_cached_tokens_total",
                   "radixpool_gateway_cached_tokens_total", "radixpool_generation_tokens_total",
                   "radixpool_num_requests_waiting", "radixpool_kv_cache_usage_ratio",
                   "radixpool_retracted_requests_total", "radixpool_gateway_worker_healthy"):
        assert needed in fleet, needed
    for word in ("latency", "throughput", "actual vs predicted", "health"):
        assert word in titles, word
    worker = boards()["radixpool-worker.json"]
    assert any(v["name"] == "pod" for v in worker["templating"]["list"])


def test_workers_up_counts_each_worker_once_whatever_the_gateway_replicas():
    panel = next(p for p in boards()["radixpool-fleet.json"]["panels"]
                 if p["title"] == "Workers up")
    healthy = next(t["expr"] for t in panel["targets"] if "gateway_worker_healthy" in t["expr"])
    # Each gateway replica exports one series per worker: they are folded per worker first.
    assert re.fullmatch(r"sum\(max by \(worker\) \(radixpool_gateway_worker_healthy\{.*\}\)\)",
                        healthy), healthy
