"""The worker's `/server_info` document: what a gateway needs to know about one worker."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields


@dataclass(frozen=True)
class ServerInfo:
    model: str                    # model path or name as loaded
    served_model_name: str        # the name clients put in `model`
    context_length: int           # max prompt + completion tokens per request
    kv_capacity_tokens: int       # KV pool size: the most tokens the radix cache can ever hold
    page_size: int                # KV page size in tokens; cache matches are page-aligned
    kv_block_size: int            # block size of the KV-event block hashes (protocol.kv_blocks)
    instance_id: str              # changes on every start and every cache flush
    version: str                  # radixpool version
    kv_events: bool = True        # whether `/kv_events` is served
    eviction_policy: str = "lru"  # radix cache eviction: lru | lfu | probation (reuse-aware)
    # Which waiting prompts the scheduler runs first: lpm (longest cached prefix: a prompt that
    # hits the cache goes ahead of colder ones queued there) | fcfs (arrival order).
    schedule_policy: str = "fcfs"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> ServerInfo:
        """Parse a worker's document; ValueError naming the field when one is missing or of the
        wrong type, or a size is not positive (a gateway must not size a tree from garbage)."""
        values = {}
        for f in fields(cls):
            if f.name not in doc:
                if f.default is MISSING:
                    raise ValueError(f"server_info: {f.name} is missing")
                continue
            value, kind = doc[f.name], _TYPES[f.type]
            if type(value) is not kind:   # exact: a bool is not a size, a number not a name
                raise ValueError(f"server_info: {f.name} must be {kind.__name__}, "
                                 f"not {type(value).__name__}")
            if f.name in _POSITIVE and value <= 0:
                raise ValueError(f"server_info: {f.name} must be > 0, not {value}")
            values[f.name] = value
        return cls(**values)


_TYPES = {"str": str, "int": int, "bool": bool}
_POSITIVE = {"context_length", "kv_capacity_tokens", "page_size", "kv_block_size"}
