"""kopf's record of the last handled spec, kept as a digest rather than a copy of the spec.

kopf decides between "created", "changed" and "nothing new" by comparing each pool with the
essence it stored after the last handling, by default a JSON copy of the whole spec in an
annotation. Annotations share a 256 KiB limit, which `kubectl apply` already half fills with its own
copy: a pool of over about 128 KiB (long env lists, large args) then makes every store fail (422),
and kopf retries it with tracebacks forever. The handlers never read kopf's old/new/diff (each
pass reconciles the whole pool), so a digest tells kopf all it needs: unchanged, or changed.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import kopf

KEY = "digest"


def digest(essence: Any) -> str:
    encoded = json.dumps(essence, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(encoded).hexdigest()


class DigestDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        super().store(body=body, patch=patch,
                      essence=kopf.BodyEssence({KEY: digest(essence)}))

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        stored = super().fetch(body=body)
        if stored is None or set(stored) != {KEY}:
            return stored  # never handled, or a whole copy an earlier version stored
        current = self.build(body=body)
        # Unchanged: the essence itself, so kopf sees no difference; changed: anything else.
        return current if stored[KEY] == digest(current) else stored
