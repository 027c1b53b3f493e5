"""The Grafana dashboards against what a real fleet exports: after a varied load (chat and
completions, a stream, a cached prefix, structured output, a bad request, a client that leaves),
every series a panel queries has samples on some `/metrics`, every label value a matcher names
occurs among them, every label a panel groups by is on them, and every `radixpool_*` sample is
one the specs declare, with their labels. `tests/test_dashboards.py` checks the queries against
the specs; this checks the specs against the running code."""

from __future__ import annotations

import json
import operator
import re
import uuid

import httpx
import openai
import promql_parser as pp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from promql_check import SERIES, TARGET_LABELS

from radixpool.operator.dashboards import dashboard_files

from .fleet_probes import MODEL, eventually, long_text, scrape

pytestmark = pytest.mark.slow

# Histogram-only labels Prometheus clients add to samples.
SAMPLE_LABELS = frozenset({"le", "quantile"})
ARITHMETIC = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def _fleet_samples(fleet) -> dict[str, list[dict[str, str]]]:
    """The label sets of every sample on every worker's and the gateway's `/metrics`, by name."""
    found: dict[str, list[dict[str, str]]] = {}
    for url in (*fleet.worker_urls, fleet.gateway.url):
        text = httpx.get(url + "/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                found.setdefault(s.name, []).append(s.labels)
    return found


def _selectors(expr: str) -> list[tuple[pp.VectorSelector, set[str]]]:
    """Each series selector of a query, with the labels the query groups it by."""
    found: list[tuple[pp.VectorSelector, set[str]]] = []

    def visit(node, grouped: set[str]) -> None:
        if isinstance(node, pp.VectorSelector):
            found.append((node, grouped))
            return
        if isinstance(node, pp.AggregateExpr) and node.modifier is not None \
                and node.modifier.type == pp.AggModifierType.By:
            grouped = grouped | set(node.modifier.labels)
        for child in ("expr", "lhs", "rhs", "vector_selector"):
            if getattr(node, child, None) is not None:
                visit(getattr(node, child), grouped)
        for arg in getattr(node, "args", None) or ():
            visit(arg, grouped)

    variable = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", expr.strip())
    if variable:
        visit(pp.parse(variable.group(1)), {variable.group(2)})
    else:
        visit(pp.parse(expr.replace("$__rate_interval", "5m")), set())
    return found


def _dashboard_queries() -> list[tuple[str, str]]:
    """(where, expr) of every panel target and query variable of the shipped dashboards."""
    found = []
    for name, text in dashboard_files().items():
        board = json.loads(text)
        for panel in board["panels"]:
            found += [(f"{name} / {panel['title']}", t["expr"]) for t in panel["targets"]]
        found += [(f"{name} / ${v['name']}", v["query"]["query"])
                  for v in board["templating"]["list"] if v["type"] == "query"]
    return found


def _matches(matcher, value: str | None) -> bool:
    """Whether `value` is one the matcher names; for `!=` and `!~` too: excluding a value that
    never occurs (a typo) excludes nothing."""
    op = str(matcher.op).rsplit(".", 1)[-1]
    if op in ("Equal", "NotEqual"):
        return value == matcher.value
    return value is not None and re.fullmatch(matcher.value, value) is not None


def _load(fleet, sdk: openai.OpenAI) -> None:
    prefix = long_text(7, 150)
    for i in range(3):   # one prefix, three questions: the later ones hit the radix cache
        sdk.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                    messages=[{"role": "user", "content": f"{prefix} q{i}"}])
    sdk.completions.create(model=MODEL, prompt=f"{prefix} c", max_tokens=4, temperature=0)
    for _ in sdk.chat.completions.create(model=MODEL, max_tokens=8, stream=True, messages=[
            {"role": "user", "content": uuid.uuid4().hex}]):
        pass
    sdk.chat.completions.create(
        model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "json"}],
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {
            "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}})
    with pytest.raises(openai.BadRequestError):
        sdk.chat.completions.create(model=MODEL, max_tokens=-1,
                                    messages=[{"role": "user", "content": "x"}])
    with sdk.chat.completions.with_streaming_response.create(
            model=MODEL, messages=[{"role": "user", "content": uuid.uuid4().hex}],
            max_tokens=1000, stream=True, extra_body={"ignore_eos": True}) as response:
        for i, _ in enumerate(response.parse()):
            if i == 3:
                break   # the client leaves: a 499 at the gateway, an abort on the worker

    def left_counted() -> bool:
        samples = _fleet_samples(fleet)
        return any(labels.get("code") == "499"
                   for labels in samples.get("radixpool_gateway_requests_total", ()))

    eventually(left_counted, "the gateway counts the client that left")


def test_every_dashboard_query_finds_the_series_and_label_values_a_fleet_exports(fleet, sdk):
    _load(fleet, sdk)
    samples = _fleet_samples(fleet)

    for name, label_sets in samples.items():
        if not name.startswith("radixpool_"):
            continue
        assert name in SERIES, f"{name} is exported but no spec declares it"
        spec = SERIES[name][0]
        for labels in label_sets:
            assert set(labels) - SAMPLE_LABELS == set(spec.labels), (name, labels, spec.labels)

    problems = []
    for where, expr in _dashboard_queries():
        for selector, grouped in _selectors(expr):
            label_sets = samples.get(selector.name, [])
            if not label_sets:
                problems.append(f"{where}: no sample of {selector.name}")
                continue
            for matcher in selector.matchers.matchers:
                if matcher.name in TARGET_LABELS:   # added by Prometheus, not the exporter
                    continue
                if not any(_matches(matcher, labels.get(matcher.name)) for labels in label_sets):
                    problems.append(f"{where}: {selector.name} has no {matcher.name} matching "
                                    f"{matcher.value!r} among "
                                    f"{sorted({ls.get(matcher.name) for ls in label_sets})}")
            for label in grouped - TARGET_LABELS:
                if not any(label in labels for labels in label_sets):
                    problems.append(f"{where}: {selector.name} has no label {label!r}")
    assert problems == [], "\n".join(problems)


def _one_worker_value(expr: str, samples: dict[str, float]) -> float:
    """A panel's query over one worker's unlabelled gauges (an aggregation of one series is that
    series), evaluated on that worker's `/metrics` as Prometheus would."""
    def value(node) -> float:
        if isinstance(node, pp.VectorSelector):
            return samples[node.name]
        if isinstance(node, (pp.AggregateExpr, pp.ParenExpr)):
            return value(node.expr)
        if isinstance(node, pp.NumberLiteral):
            return node.val
        if isinstance(node, pp.BinaryExpr):
            return ARITHMETIC[str(node.op)](value(node.lhs), value(node.rhs))
        raise AssertionError(f"not a one-worker gauge query: {expr}")

    return value(pp.parse(expr))


def test_an_idle_worker_with_a_warm_cache_shows_no_kv_held_by_requests(fleet, sdk):
    # The KV panels plotted radixpool_kv_cache_usage_ratio alone, which counts the radix cache:
    # a warm worker's pool fills with cache and stays near full, idle or not, so the fleet
    # board read as memory pressure what is reuse, evicted the moment a request needs room.
    raw = sdk.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": long_text(11, 300)}])
    worker = raw.headers["x-radixpool-worker"]
    eventually(lambda: scrape(worker)["radixpool_num_requests_running"] == 0, "the worker idles")
    samples = scrape(worker)
    assert samples["radixpool_kv_cache_usage_ratio"] * samples[
        "radixpool_kv_cache_capacity_tokens"] >= 300   # its cache holds the prompt
    panel = next(p for p in json.loads(dashboard_files()["radixpool-fleet.json"])["panels"]
                 if p["title"].startswith("KV "))
    (target,) = panel["targets"]
    assert _one_worker_value(target["expr"], samples) == pytest.approx(0, abs=1e-9), panel
