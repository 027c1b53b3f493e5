"""What a worker says about itself, in either dialect the gateway fronts.

- A RadixPool worker answers `GET /server_info` with `protocol.server_info.ServerInfo`.
- An SGLang server answers `GET /get_server_info` with its server arguments plus the scheduler's
  numbers; the one the gateway needs is `max_total_num_tokens`, the KV pool size in tokens, which
  bounds that worker's tree, and `radix_eviction_policy` (its `lfu` and `slru` protect reused
  prefixes, as ours do). It has no instance id and no KV-event stream of ours: its tree is
  corrected by the `cached_tokens` its answers report.
"""

from __future__ import annotations

from radixpool.protocol.kv_blocks import DEFAULT_BLOCK_SIZE
from radixpool.protocol.server_info import ServerInfo

INFO_PATHS = ("/server_info", "/get_server_info")
UNKNOWN_CONTEXT = 1 << 31


def parse_server_info(doc: object) -> ServerInfo | None:
    """The worker's description, or None when `doc` is neither dialect (or is malformed)."""
    if not isinstance(doc, dict):
        return None
    try:
        if "kv_capacity_tokens" in doc and "instance_id" in doc:
            return ServerInfo.from_json(doc)
        capacity = _sglang_capacity(doc)
        if capacity is None:
            return None
        model = str(doc.get("model_path") or doc.get("served_model_name") or "")
        return ServerInfo(
            model=model, served_model_name=str(doc.get("served_model_name") or model),
            context_length=int(doc.get("context_length") or UNKNOWN_CONTEXT),
            kv_capacity_tokens=capacity, page_size=int(doc.get("page_size") or 1),
            kv_block_size=DEFAULT_BLOCK_SIZE, instance_id="",
            version=f"sglang {doc.get('version', '')}".strip(), kv_events=False,
            eviction_policy=str(doc.get("radix_eviction_policy") or "lru").lower(),
            schedule_policy=str(doc.get("schedule_policy") or "fcfs").lower())
    except (TypeError, ValueError):
        return None


def _sglang_capacity(doc: dict) -> int | None:
    """`max_total_num_tokens` at the top level, or in the first scheduler's internal state."""
    value = doc.get("max_total_num_tokens")
    states = doc.get("internal_states")
    if value is None and isinstance(states, list) and states and isinstance(states[0], dict):
        value = states[0].get("max_total_num_tokens")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value
