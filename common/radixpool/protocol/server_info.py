"""The worker's `/server_info` document: what a gateway needs to know about one worker."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


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

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> ServerInfo:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in doc.items() if k in known})
