"""A dashboard query checker: parses PromQL with `promql_parser` and judges each series it uses
against the metric specs, the way an SRE reading the panel would.

`problems(expr)` names what is wrong with one query:
- it does not parse;
- a series no spec exports, or a label (in a matcher, `by`/`without` or the legend) the series
  do not carry;
- `rate()`/`irate()`/`increase()` over a gauge or info metric, or a counter or histogram
  series plotted raw (an ever-rising line);
- two vectors combined (`/`, `>`, ...) whose labels cannot pair up (an empty panel), `on()`
  naming a label one side lacks, or `group_left()`/`group_right()` copying a label the "one"
  side lacks (the result carries the labels it copies);
- a `_bucket` series anywhere but under `histogram_quantile`, or one whose aggregation drops `le`.
"""

from __future__ import annotations

import re

import promql_parser as pp

from radixpool.protocol.metrics import ALL_METRICS, MetricSpec

# Labels Prometheus and the chart's ServiceMonitor (podTargetLabels) add to every series.
TARGET_LABELS = frozenset({"namespace", "pod", "instance", "job", "radixpool_io_pool",
                           "app_kubernetes_io_component", "service", "endpoint", "container"})
GRAFANA_DURATIONS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
RANGE_FUNCTIONS = frozenset({"rate", "irate", "increase"})
SET_OPERATORS = frozenset({"and", "or", "unless"})
SERIES: dict[str, tuple[MetricSpec, str]] = {
    series: (spec, series[len(spec.name):]) for spec in ALL_METRICS for series in spec.series}


def _labels_of_series(name: str) -> frozenset[str]:
    spec, suffix = SERIES[name]
    return TARGET_LABELS | set(spec.labels) | ({"le"} if suffix == "_bucket" else set())


class _Checker:
    def __init__(self) -> None:
        self.found: list[str] = []

    def labels(self, node, in_range: bool = False, in_quantile: bool = False) -> frozenset[str]:
        """The labels `node`'s result carries; records problems on the way down."""
        if isinstance(node, pp.VectorSelector):
            return self.selector(node, in_range, in_quantile)
        if isinstance(node, pp.MatrixSelector):
            return self.labels(node.vector_selector, in_range, in_quantile)
        if isinstance(node, (pp.ParenExpr, pp.UnaryExpr, pp.SubqueryExpr)):
            return self.labels(node.expr, in_range, in_quantile)
        if isinstance(node, (pp.NumberLiteral, pp.StringLiteral)):
            return frozenset()
        if isinstance(node, pp.Call):
            return self.call(node, in_quantile)
        if isinstance(node, pp.AggregateExpr):
            return self.aggregate(node, in_range, in_quantile)
        if isinstance(node, pp.BinaryExpr):
            left = self.labels(node.lhs, in_range, in_quantile)
            right = self.labels(node.rhs, in_range, in_quantile)
            if _is_scalar(node.lhs) or _is_scalar(node.rhs):
                return right if _is_scalar(node.lhs) else left
            self.matching(node, left, right)
            return self.joined(node, left, right)
        self.found.append(f"unexpected PromQL node {type(node).__name__}: {node}")
        return frozenset()

    def selector(self, node, in_range: bool, in_quantile: bool) -> frozenset[str]:
        if node.name not in SERIES:
            self.found.append(f"{node.name!r} is not a series any spec exports")
            return TARGET_LABELS
        spec, suffix = SERIES[node.name]
        available = _labels_of_series(node.name)
        for matcher in node.matchers.matchers:
            self.need(matcher.name, available, f"matcher on {node.name}")
        if spec.kind in ("gauge", "info") and in_range:
            self.found.append(f"rate/increase over the {spec.kind} {node.name}")
        if spec.kind in ("counter", "histogram") and not in_range:
            self.found.append(f"the {spec.kind} series {node.name} is plotted raw (no rate)")
        if suffix == "_bucket" and not in_quantile:
            self.found.append(f"{node.name} outside histogram_quantile")
        return available

    def matching(self, node, left: frozenset[str], right: frozenset[str]) -> None:
        """Two vectors pair up series by series on their labels (all of them, those `on()`
        names, or all but those `ignoring()` names): a series with no partner is dropped, and
        sides that carry different labels give an empty panel."""
        if str(node.op) in SET_OPERATORS:
            return
        modifier = node.modifier
        matching = modifier.matching if modifier is not None else None
        if matching is not None and matching.type == pp.LabelModifierType.Include:
            for label in matching.labels:
                self.need(label, left, f"on() in {node}, left side")
                self.need(label, right, f"on() in {node}, right side")
            return
        ignored = frozenset(matching.labels) if matching is not None else frozenset()
        for label in ignored:
            self.need(label, left | right, f"ignoring() in {node}")
        one_to_one = modifier is None or modifier.card == pp.VectorMatchCardinality.OneToOne
        if one_to_one and left - ignored != right - ignored:
            self.found.append(f"the sides of {node} carry different labels "
                              f"({sorted((left ^ right) - ignored)}): no series pairs up")

    def joined(self, node, left: frozenset[str], right: frozenset[str]) -> frozenset[str]:
        """The labels of a binary operation's result: the "many" side's (the left one, but for
        `group_right`), plus those `group_left(...)`/`group_right(...)` copy from the other."""
        modifier = node.modifier
        card = modifier.card if modifier is not None else None
        if card == pp.VectorMatchCardinality.ManyToOne:
            many, one, side = left, right, "right"
        elif card == pp.VectorMatchCardinality.OneToMany:
            many, one, side = right, left, "left"
        else:
            return left
        copied = frozenset(modifier.group_labels)
        for label in copied:
            self.need(label, one, f"group_left/group_right in {node}, {side} side")
        return many | copied

    def call(self, node, in_quantile: bool) -> frozenset[str]:
        name = node.func.name
        if name == "histogram_quantile":
            inner = self.labels(node.args[1], in_quantile=True)
            if "le" not in inner:
                self.found.append(f"histogram_quantile over series without `le`: {node}")
            return inner - {"le"}
        result: frozenset[str] = frozenset()
        for arg in node.args:
            labels = self.labels(arg, name in RANGE_FUNCTIONS, in_quantile)
            result = result or labels
        if name in RANGE_FUNCTIONS and not isinstance(node.args[0], pp.MatrixSelector):
            self.found.append(f"{name}() over something other than a range selector: {node}")
        return result

    def aggregate(self, node, in_range: bool, in_quantile: bool) -> frozenset[str]:
        inner = self.labels(node.expr, in_range, in_quantile)
        if node.param is not None:
            self.labels(node.param, in_range, in_quantile)
        op = str(node.op)
        if node.modifier is None:
            return inner if op in ("topk", "bottomk") else frozenset()
        grouped = frozenset(node.modifier.labels)
        for label in grouped:
            self.need(label, inner, f"{op} by/without")
        if op in ("topk", "bottomk"):   # they pick series within each group, labels and all
            return inner
        if node.modifier.type == pp.AggModifierType.By:
            return grouped
        return inner - grouped

    def need(self, label: str, available: frozenset[str], where: str) -> None:
        if label not in available:
            self.found.append(f"label {label!r} ({where}) is not on the series")


def _is_scalar(node) -> bool:
    """Whether `node` is a plain number (which pairs with every series), not a vector."""
    if isinstance(node, pp.NumberLiteral):
        return True
    if isinstance(node, (pp.ParenExpr, pp.UnaryExpr)):
        return _is_scalar(node.expr)
    if isinstance(node, pp.Call):
        return node.func.return_type == pp.ValueType.Scalar
    if isinstance(node, pp.BinaryExpr):
        return _is_scalar(node.lhs) and _is_scalar(node.rhs)
    return False


def _grafana_to_promql(expr: str) -> str:
    for variable, duration in GRAFANA_DURATIONS.items():
        expr = expr.replace(variable, duration)
    return expr


def problems(expr: str, legend: str = "") -> list[str]:
    """What is wrong with one dashboard query (empty: nothing)."""
    checker = _Checker()
    variable = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", expr.strip())
    try:
        ast = pp.parse(_grafana_to_promql(variable.group(1) if variable else expr))
    except ValueError as error:
        return [f"does not parse: {error}"]
    if variable:
        if not isinstance(ast, pp.VectorSelector):
            return [f"label_values over a non-selector: {expr}"]
        available = checker.selector(ast, in_range=False, in_quantile=False)
        checker.need(variable.group(2), available, "label_values")
        return checker.found
    result = checker.labels(ast)
    for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", legend):
        checker.need(label, result, f"legend {legend!r}")
    return checker.found
