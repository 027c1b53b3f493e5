"""kopf's last-handled record is a digest: small whatever the spec, and still tells changes."""

from __future__ import annotations

import json

import kopf

from radixpool.operator.diffbase import DigestDiffBaseStorage

KEY = "radixpool.io/last-handled-configuration"


def stored_after_handling(storage, body: dict) -> dict:
    patch = kopf.Patch()
    storage.store(body=kopf.Body(body), patch=patch, essence=storage.build(body=kopf.Body(body)))
    annotations = {**body["metadata"].get("annotations", {}),
                   **patch["metadata"]["annotations"]}
    return {**body, "metadata": {**body["metadata"], "annotations": annotations}}


def test_a_huge_spec_leaves_a_small_record_and_changes_are_still_seen(pool_body):
    storage = DigestDiffBaseStorage(prefix="radixpool.io")
    body = pool_body(engine={"args": ["--chat-template", "x" * 200_000]})
    handled = stored_after_handling(storage, body)
    assert len(handled["metadata"]["annotations"][KEY]) < 100  # not 200 kB (limit: 256 KiB)

    unchanged = kopf.Body(handled)
    assert storage.fetch(body=unchanged) == storage.build(body=unchanged)  # nothing to handle
    edited = kopf.Body({**handled, "spec": {**handled["spec"], "replicas": 3}})
    assert storage.fetch(body=edited) != storage.build(body=edited)  # an update to handle
    assert storage.fetch(body=kopf.Body(body)) is None  # never handled: a creation


def test_a_whole_copy_left_by_an_earlier_version_still_reads(pool_body):
    storage = DigestDiffBaseStorage(prefix="radixpool.io")
    body = pool_body()
    essence = storage.build(body=kopf.Body(body))
    body["metadata"]["annotations"] = {KEY: json.dumps(essence)}
    assert storage.fetch(body=kopf.Body(body)) == essence
