"""`GET /v1/models` of a fleet whose workers may serve different models.

The gateway routes a request naming a model to the workers serving it, so its model list is the
union of theirs: one eligible worker is asked per model it serves (the least loaded; a worker
whose model is not known yet is asked on its own), and their lists are merged, first answer
first, each model id once; a worker that does not answer within `MODEL_LIST_TIMEOUT_S` is left
out. Pure: the proxy does the asking.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from radixpool.gateway.workers import Worker

# A worker answers its model list from memory: one silent this long is hung, and must not hold up
# the other models' answers for the whole `upstream_first_byte_timeout`.
MODEL_LIST_TIMEOUT_S = 5.0


def one_per_model(workers: Sequence[Worker]) -> list[Worker]:
    """The least loaded worker of each model among `workers`, in the order models first appear;
    workers whose model is unknown each stand for themselves."""
    chosen: dict[str, Worker] = {}
    for worker in workers:
        group = worker.model if worker.model is not None else worker.url
        held = chosen.get(group)
        if held is None or worker.inflight < held.inflight:
            chosen[group] = worker
    return list(chosen.values())


def merge_model_lists(bodies: Sequence[bytes]) -> bytes | None:
    """The union of several `/v1/models` answers (each model id once, in order of appearance);
    None when no body is a model list."""
    models: dict[str, dict] = {}
    understood = False
    for body in bodies:
        try:
            doc = json.loads(body)
        except ValueError:
            continue
        data = doc.get("data") if isinstance(doc, dict) else None
        if not isinstance(data, list):
            continue
        understood = True
        for model in data:
            if isinstance(model, dict) and isinstance(model.get("id"), str):
                models.setdefault(model["id"], model)
    if not understood:
        return None
    return json.dumps({"object": "list", "data": list(models.values())}).encode()
