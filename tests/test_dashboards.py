"""Dashboards query only series the worker and gateway export, the way PromQL and an SRE need
them (parsed by `promql_parser`, see `promql_check`), and the chart ships the same."""

from __future__ import annotations

import json
import re
from pathlib import Path

import promql_parser as pp
import pytest
from promql_check import SERIES, problems

from radixpool.operator.dashboards import DASHBOARD_DIRS, dashboard_files
from radixpool.protocol import metrics as m

REPO = Path(__file__).resolve().parents[1]
# Counters whose rate is requests per second (the rest count tokens or events).
REQUEST_COUNTERS = {s.name for s in (
    m.REQUESTS, m.RETRACTED_REQUESTS, m.GW_REQUESTS, m.GW_ROUTE_DECISIONS, m.GW_RETRIES,
    m.GW_QUARANTINED, m.GW_UPSTREAM_TIMEOUTS, m.GW_WAIT_QUEUE_OUTCOMES, m.NONFINITE_LOGITS)}


def queries(board: dict) -> list[tuple[str, str]]:
    """(expr, legend) of every panel target and query variable."""
    found = [(t["expr"], t.get("legendFormat", ""))
             for panel in board["panels"] for t in panel.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            found.append((variable["query"]["query"], ""))
    return found


def boards() -> dict[str, dict]:
    return {name: json.loads((REPO / "dashboards" / name).read_text())
            for name in dashboard_files()}


def series_names(expr: str) -> list[str]:
    names: list[str] = []
    pp.walk(pp.parse(expr.replace("$__rate_interval", "5m")),
            lambda node: names.append(node.name) if isinstance(node, pp.VectorSelector) else None)
    return names


def fitting_units(expr: str) -> set[str]:
    """Grafana units a query's values can be shown in."""
    specs = [SERIES[name][0] for name in series_names(expr)]
    if expr.startswith("histogram_quantile("):
        return {"s"} if specs[0].name.endswith("_seconds") else {"short"}
    if " / " in expr or specs[0].name.endswith(("_ratio", "_hit_rate")):
        return {"percentunit"}
    if expr.find("rate(") >= 0:
        if specs[0].name in REQUEST_COUNTERS:
            return {"reqps"}
        return {"short"} if "tokens" in specs[0].name else {"ops"}
    if specs[0] is m.GW_WORKER_HEALTHY and expr.startswith("min by"):
        return {"bool_yes_no"}
    return {"short"}


def test_dashboard_files_in_repo_and_chart_are_current():
    for folder in DASHBOARD_DIRS:
        for name, text in dashboard_files().items():
            path = REPO / folder / name
            assert path.exists() and path.read_text() == text, (
                f"{path} is stale: run `python -m radixpool.operator.dashboards`")


@pytest.mark.parametrize("name", sorted(dashboard_files()))
def test_every_query_parses_and_uses_exported_series_and_labels_as_their_kind_allows(name):
    found = queries(boards()[name])
    assert len(found) >= 10
    for expr, legend in found:
        assert problems(expr, legend) == [], expr


@pytest.mark.parametrize("name", sorted(dashboard_files()))
def test_every_panel_has_the_unit_its_queries_are_in(name):
    for panel in boards()[name]["panels"]:
        unit = panel["fieldConfig"]["defaults"]["unit"]
        if unit == "percentunit":
            assert (panel["fieldConfig"]["defaults"]["min"],
                    panel["fieldConfig"]["defaults"]["max"]) == (0, 1), panel["title"]
        for target in panel["targets"]:
            assert unit in fitting_units(target["expr"]), (
                f"{panel['title']!r} is in {unit!r} but {target['expr']} is in "
                f"{fitting_units(target['expr'])}")


@pytest.mark.parametrize(("expr", "legend", "complaint"), [
    ('sum(rate(radixpool_made_up_total{pod="x"}[5m]))', "", "not a series any spec exports"),
    ("up", "", "not a series any spec exports"),
    ("radixpool_time_to_first_token_seconds", "", "not a series any spec exports"),
    ("sum(rate(radixpool_requests_total[5m]", "", "does not parse"),
    ("sum(rate(radixpool_num_requests_waiting[5m]))", "", "over the gauge"),
    ("sum(radixpool_gateway_retries_total)", "", "plotted raw"),
    ("sum by (worker) (rate(radixpool_retracted_requests_total[5m]))", "",
     "label 'worker'"),
    ('sum(rate(radixpool_gateway_retries_total{code="500"}[5m]))', "", "label 'code'"),
    ("sum by (code) (rate(radixpool_gateway_requests_total[5m]))", "{{pod}}", "label 'pod'"),
    ("histogram_quantile(0.9, sum(rate(radixpool_queue_time_seconds_bucket[5m])))", "",
     "without `le`"),
    ("sum(rate(radixpool_queue_time_seconds_bucket[5m]))", "", "outside histogram_quantile"),
    ("label_values(radixpool_worker_info, worker)", "", "label 'worker'"),
    ("rate(radixpool_worker_info[5m])", "", "over the info"),
    ("sum by (pod) (rate(radixpool_cached_prompt_tokens_total[5m])) / "
     "sum(rate(radixpool_prompt_tokens_total[5m]))", "", "different labels"),
    ("rate(radixpool_requests_total[5m]) / rate(radixpool_prompt_tokens_total[5m])", "",
     "different labels"),
    ("sum by (worker) (rate(radixpool_gateway_cached_tokens_total[5m])) / on (worker) "
     "sum(rate(radixpool_gateway_prompt_tokens_total[5m]))", "", "label 'worker' (on()"),
    ("sum by (pod) (rate(radixpool_requests_total[5m])) * on (pod) group_left (model) "
     "max by (pod) (radixpool_worker_info)", "{{model}}", "label 'model' (group_left"),
    ("sum by (pod) (rate(radixpool_requests_total[5m])) * on (pod) group_left "
     "max by (pod, model) (radixpool_worker_info)", "{{model}}", "label 'model' (legend"),
])
def test_the_checker_catches_what_a_panel_gets_wrong(expr, legend, complaint):
    assert any(complaint in problem for problem in problems(expr, legend)), problems(expr, legend)


@pytest.mark.parametrize(("expr", "legend"), [
    ('histogram_quantile(0.99, sum by (le, pod) (rate('
     'radixpool_time_to_first_token_seconds_bucket{pod=~"$pod"}[$__rate_interval])))',
     "p99 {{pod}}"),
    ("sum by (pod) (rate(radixpool_cached_prompt_tokens_total[5m])) / "
     "sum by (pod) (rate(radixpool_prompt_tokens_total[5m]))", "{{pod}}"),
    ("sum by (pod, finish_reason) (rate(radixpool_requests_total[5m])) / ignoring "
     "(finish_reason) group_left sum by (pod) (rate(radixpool_requests_total[5m]))", ""),
    ("sum(rate(radixpool_queue_time_seconds_sum[5m])) / "
     "sum(rate(radixpool_queue_time_seconds_count[5m])) * 1000 > 0.5", ""),
    # a join copying an info series' label onto each line; topk keeps one per pod, labels and all
    ("sum by (pod) (rate(radixpool_requests_total[5m])) * on (pod) group_left (model) "
     "topk by (pod) (1, radixpool_worker_info)", "{{pod}} {{model}}"),
    ("max by (pod) (radixpool_worker_info) * on (pod) group_right "
     "sum by (pod, finish_reason) (rate(radixpool_requests_total[5m]))", "{{finish_reason}}"),
])
def test_the_checker_passes_a_well_formed_query(expr, legend):
    assert problems(expr, legend) == []


def codes_selected(expr: str, codes: tuple[str, ...]) -> set[str]:
    """The HTTP codes a query's `code` matchers let through."""
    kept = set(codes)
    for op, pattern in re.findall(r'code\s*(=~|!~|=|!=)\s*"([^"]*)"', expr):
        match = {c for c in codes if (re.fullmatch(pattern, c) if "~" in op else c == pattern)}
        kept &= match if op in ("=~", "=") else set(codes) - match
    return kept


def test_fleet_view_covers_what_operators_watch():
    board = boards()["radixpool-fleet.json"]
    fleet = " ".join(expr for expr, _ in queries(board))
    titles = " ".join(p["title"] for p in board["panels"]).lower()
    for spec in (m.TIME_TO_FIRST_TOKEN, m.INTER_TOKEN_LATENCY, m.GW_PREDICTED_CACHED_TOKENS,
                 m.GW_CACHED_TOKENS, m.GENERATION_TOKENS, m.NUM_REQUESTS_WAITING,
                 m.KV_CACHE_USAGE, m.RETRACTED_REQUESTS, m.GW_WORKER_HEALTHY, m.GW_REQUESTS,
                 m.GW_RETRIES, m.GW_QUARANTINED, m.GW_UPSTREAM_TIMEOUTS, m.GW_WAIT_QUEUE,
                 m.GW_TREE_CORRECTIONS, m.GW_BREAKER_STATE):
        assert spec.name in fleet, spec.name
    for word in ("latency", "throughput", "actual vs predicted", "health", "errors",
                 "quarantines", "timeouts", "wait queue", "circuit breakers"):
        assert word in titles, word
    errors = next(p for p in board["panels"] if p["title"] == "Gateway errors / s")
    selected = {t["expr"]: codes_selected(t["expr"], ("200", "400", "404", "499", "500", "502",
                                                      "503", "504"))
                for t in errors["targets"]}
    # one line per server error; what clients cause (bad requests, 499: chat clients leave all
    # the time) is one line of its own, not lines that crowd the server errors out
    split = [codes for expr, codes in selected.items() if "by (code)" in expr]
    assert split == [{"500", "502", "503", "504"}], selected
    assert {"400", "404", "499"} in selected.values(), selected
    worker = boards()["radixpool-worker.json"]
    assert any(v["name"] == "pod" for v in worker["templating"]["list"])
    assert m.KV_DOUBLE_FREES.name in " ".join(expr for expr, _ in queries(worker))


def test_workers_up_counts_each_worker_once_whatever_the_gateway_replicas():
    board = boards()["radixpool-fleet.json"]
    panel = next(p for p in board["panels"] if p["title"] == "Workers up")
    healthy = next(t["expr"] for t in panel["targets"] if "gateway_worker_healthy" in t["expr"])
    # Each gateway replica exports one series per worker: they are folded per worker first.
    assert re.fullmatch(r"sum\(max by \(worker\) \(radixpool_gateway_worker_healthy\{.*\}\)\)",
                        healthy), healthy
    # So do they each worker's pod name, and two replicas may name two pods for one address a
    # moment after a new pod reuses it: a join takes one per worker (else lines double, or the
    # query fails on duplicate series on its "one" side).
    info = m.GW_WORKER_INFO.series[0]
    joins = [expr for expr, _ in queries(board) if info in expr]
    assert joins
    for expr in joins:
        assert expr.count(info) == expr.count(f"topk by (worker) (1, {info}{{"), expr


def test_per_worker_gateway_panels_name_the_workers_pods():
    # The gateway's per-worker series carry the worker's address: the panels' lines read
    # "http://10.1.2.3:8000", no pod an SRE could find on the worker board, and a restarted
    # pod showed as a new address. They show the pod's name (`worker_pod`) instead.
    per_worker = [(panel["title"], t) for panel in boards()["radixpool-fleet.json"]["panels"]
                  for t in panel["targets"] if re.search(r"by \(worker\b", t["expr"])]
    assert {title for title, _ in per_worker} >= {
        "In flight per worker (gateway)", "Worker health", "Circuit breakers not closed",
        "Routing tree size per worker (gateway)",
        "Retries, quarantines and upstream timeouts / s"}
    for title, target in per_worker:
        if title == "Workers up":   # a count, no line per worker
            continue
        assert "{{worker_pod}}" in target["legendFormat"], (title, target)
        assert "{{worker}}" not in target["legendFormat"], (title, target)
        assert "group_left (worker_pod)" in target["expr"], (title, target)


# Grafana's thresholds for a stat panel that sets none.
GRAFANA_DEFAULT_THRESHOLDS = {"mode": "absolute", "steps": [{"color": "green", "value": None},
                                                            {"color": "red", "value": 80}]}


def colour(panel: dict, value: float) -> str:
    """The colour Grafana gives `value` on a stat panel: that of the last step at or below it."""
    thresholds = panel["fieldConfig"]["defaults"].get("thresholds", GRAFANA_DEFAULT_THRESHOLDS)
    return [step["color"] for step in thresholds["steps"]
            if step["value"] is None or step["value"] <= value][-1]


def test_stat_panels_colour_an_unhealthy_worker_red_and_a_large_pool_not():
    # Without thresholds a worker failing its health checks (0) showed green, like a healthy
    # one, and "Workers up" turned red for any pool of 80 workers or more.
    panels = {p["title"]: p for p in boards()["radixpool-fleet.json"]["panels"]}
    assert (colour(panels["Worker health"], 0), colour(panels["Worker health"], 1)) == \
        ("red", "green")
    assert {colour(panels["Workers up"], n) for n in (0, 1, 80, 500)} - {"text"} == set()


def test_worker_hit_rate_follows_the_boards_window_not_the_last_1000_requests():
    # radixpool_cache_hit_rate covers a worker's last 1000 requests however old they are: an
    # idle worker, or one whose traffic changed an hour before, showed that old rate as now.
    panel = next(p for p in boards()["radixpool-worker.json"]["panels"]
                 if p["title"] == "Cache hit rate")
    (target,) = panel["targets"]
    assert set(series_names(target["expr"])) == {m.CACHED_PROMPT_TOKENS.name,
                                                 m.PROMPT_TOKENS.name}
    assert target["expr"].count("[$__rate_interval]") == 2


# Exported but on no board, and why.
OFF_THE_BOARDS = {
    # the boards compute hit rates over their own window from the token counters
    m.CACHE_HIT_RATE.name: "the worker's last 1000 requests, however old",
    m.GW_HIT_RATE.name: "since the gateway started",
}


def test_every_exported_metric_is_on_a_board_or_left_off_for_a_reason():
    # The structured-output metrics (grammar compile time, grammar cache hits) and the size of
    # the gateway's routing trees were exported, documented, and on no board.
    text = "".join(dashboard_files().values())
    missing = [s.name for s in m.ALL_METRICS
               if s.name not in OFF_THE_BOARDS and not any(x in text for x in s.series)]
    assert missing == []
    assert all(name not in text for name in OFF_THE_BOARDS)


def test_hit_rate_panel_says_which_gap_means_stale_routing():
    # Predictions count whole routing blocks: on a healthy local fleet actual was 0.56 and
    # predicted 0.47, and the panel called any gap stale routing trees. Only a prediction
    # above what the workers had is one.
    panel = next(p for p in boards()["radixpool-fleet.json"]["panels"]
                 if p["title"] == "Cache hit rate: actual vs predicted")
    assert "predicted above actual" in panel["description"]
    assert "a gap means stale" not in panel["description"]


def test_the_pool_label_the_boards_filter_on_is_one_both_service_monitors_add():
    # prometheus-operator makes each podTargetLabels entry a target label, other characters
    # than [a-zA-Z0-9_] turned to "_": were the pod label renamed, every panel would go empty.
    from radixpool.operator import api
    from radixpool.operator.desired import desired_service_monitor
    from radixpool.operator.spec import parse_pool

    def target_label(pod_label: str) -> str:
        return re.sub(r"[^a-zA-Z0-9_]", "_", pod_label)

    pool = parse_pool({"apiVersion": api.API_VERSION, "kind": api.KIND,
                       "metadata": {"name": "p", "namespace": "ns", "uid": "u",
                                    "generation": 1},
                       "spec": {"model": {"path": "/models/p"}}})
    own = desired_service_monitor(pool)["spec"]["podTargetLabels"]
    chart = (REPO / "charts/radixpool/templates/servicemonitor.yaml").read_text()
    fleet_wide = re.findall(r"^\s+- ([\w./-]+)$", chart.split("podTargetLabels:")[1],
                            re.MULTILINE)
    for labels in (own, fleet_wide):
        assert "radixpool_io_pool" in {target_label(label) for label in labels}, labels
    for expr, _ in queries(boards()["radixpool-fleet.json"]):
        if "$pool" in expr:
            assert 'radixpool_io_pool=~"$pool"' in expr or "radixpool_io_pool)" in expr, expr
