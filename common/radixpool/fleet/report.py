"""The demo's numbers: one `RunSummary` per policy from the client's results and the gateway's
report, and the side-by-side table. Pure functions; nothing here does I/O."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from radixpool.fleet.client import ChatResult


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(math.ceil(q / 100 * len(ordered)), 1)
    return ordered[rank - 1]


@dataclass(frozen=True)
class RunSummary:
    policy: str
    requests: int
    failed: int
    wall_s: float
    completion_tokens: int
    ttft_p50_s: float
    ttft_p99_s: float
    prompt_tokens: int
    cached_tokens: int
    hit_rate_by_kind: dict[str, float]
    predicted_hit_rate: float | None   # the gateway's own estimate (GET /workers)
    worker_share: dict[str, float]     # worker URL -> fraction of answered requests
    first_error: str | None = None

    @property
    def throughput(self) -> float:
        return (self.requests - self.failed) / self.wall_s if self.wall_s else 0.0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def summarize(policy: str, results: list[tuple[str, ChatResult]], wall_s: float,
              predicted_hit_rate: float | None, worker_urls: list[str]) -> RunSummary:
    """`results`: (workload kind, result) for every request sent."""
    ok = [r for _, r in results if r.ok]
    by_kind: dict[str, list[int]] = {}
    for kind, r in results:
        if r.ok:
            acc = by_kind.setdefault(kind, [0, 0])
            acc[0] += r.prompt_tokens
            acc[1] += r.cached_tokens
    served = Counter(r.worker for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    return RunSummary(
        policy=policy, requests=len(results), failed=len(results) - len(ok), wall_s=wall_s,
        completion_tokens=sum(r.completion_tokens for r in ok),
        ttft_p50_s=percentile(ttfts, 50), ttft_p99_s=percentile(ttfts, 99),
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        cached_tokens=sum(r.cached_tokens for r in ok),
        hit_rate_by_kind={k: c / p if p else 0.0 for k, (p, c) in sorted(by_kind.items())},
        predicted_hit_rate=predicted_hit_rate,
        worker_share={url: served.get(url, 0) / len(ok) if ok else 0.0 for url in worker_urls},
        first_error=next((r.error for _, r in results if not r.ok), None),
    )


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def _ms(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{1000 * x:,.0f} ms"


def format_table(runs: list[RunSummary]) -> str:
    """Rows of metrics, one column per policy, and a last column comparing the first two."""
    kinds = sorted({k for r in runs for k in r.hit_rate_by_kind})
    rows: list[tuple[str, list[str]]] = [
        ("requests (failed)", [f"{r.requests} ({r.failed})" for r in runs]),
        ("wall time", [f"{r.wall_s:.1f} s" for r in runs]),
        ("throughput", [f"{r.throughput:.2f} req/s" for r in runs]),
        ("TTFT p50", [_ms(r.ttft_p50_s) for r in runs]),
        ("TTFT p99", [_ms(r.ttft_p99_s) for r in runs]),
        ("cache hit rate (workers)", [_pct(r.hit_rate) for r in runs]),
        *((f"  {kind}", [_pct(r.hit_rate_by_kind.get(kind)) for r in runs]) for kind in kinds),
        ("predicted hit rate (gateway)", [_pct(r.predicted_hit_rate) for r in runs]),
        ("prompt tokens computed", [f"{r.computed_tokens:,} of {r.prompt_tokens:,}"
                                    for r in runs]),
        ("worker share", [" / ".join(f"{100 * s:.0f}" for s in r.worker_share.values()) + " %"
                          for r in runs]),
    ]
    label_w = max(len(label) for label, _ in rows)
    col_w = [max(len(r.policy), *(len(cells[i]) for _, cells in rows)) for i, r in enumerate(runs)]
    lines = [" " * label_w + "  " + "  ".join(r.policy.rjust(w) for r, w in zip(runs, col_w))]
    for label, cells in rows:
        lines.append(label.ljust(label_w) + "  " +
                     "  ".join(c.rjust(w) for c, w in zip(cells, col_w)))
    return "\n".join(lines)


def verdict(aware: RunSummary, baseline: RunSummary) -> str:
    """One sentence on what cache-aware routing bought over the baseline."""
    speedup = aware.throughput / baseline.throughput if baseline.throughput else math.inf
    saved = 1 - aware.computed_tokens / baseline.computed_tokens \
        if baseline.computed_tokens else 0.0
    return (f"{aware.policy} vs {baseline.policy}: {speedup:.1f}x the throughput, "
            f"{100 * saved:.0f} % fewer prompt tokens computed, TTFT p50 "
            f"{_ms(aware.ttft_p50_s)} vs {_ms(baseline.ttft_p50_s)}.")
