"""The kopf handlers are glue: they write the reconciled status into kopf's patch, post the
events, and turn API failures into retries."""

from __future__ import annotations

import kopf
import pytest
from kubernetes.client.exceptions import ApiException

from radixpool.operator import handlers
from radixpool.operator.desired import OperatorConfig


@pytest.fixture
def posted(monkeypatch) -> list[tuple[str, str]]:
    events: list[tuple[str, str]] = []
    monkeypatch.setattr(handlers.kopf, "event", lambda body, *, type, reason, message:
                        events.append((type, reason)))
    return events


def test_handler_writes_status_and_posts_the_warning(cluster, pool_body, posted):
    patch = kopf.Patch()
    memo = kopf.Memo(cluster=cluster, config=OperatorConfig())
    handlers.apply_pool(body=kopf.Body(pool_body(replicas=3, gateway={"policy": "nope"})),
                        patch=patch, memo=memo)
    accepted = next(c for c in patch["status"]["conditions"] if c["type"] == "Accepted")
    assert accepted["status"] == "False" and "spec.gateway.policy" in accepted["message"]
    assert patch["status"]["ready"] == "0/3"
    assert posted == [("Warning", "InvalidSpec")]
    assert cluster.objects == {}


def test_timer_applies_a_valid_pool(cluster, pool_body, posted):
    patch = kopf.Patch()
    handlers.check_pool(body=kopf.Body(pool_body()), patch=patch,
                        memo=kopf.Memo(cluster=cluster, config=OperatorConfig()))
    assert cluster.get("Deployment", "ml", "llama-worker") is not None
    assert patch["status"]["endpoint"] == "http://llama-gateway.ml.svc:8080"
    assert ("Normal", "Valid") in posted


def test_api_failures_become_retries(pool_body, make_cluster, posted):
    class Unavailable(make_cluster):
        def apply(self, obj, *, dry_run=False):
            raise ApiException(status=503, reason="Service Unavailable")

    with pytest.raises(kopf.TemporaryError, match="503"):
        handlers.apply_pool(body=kopf.Body(pool_body()), patch=kopf.Patch(),
                            memo=kopf.Memo(cluster=Unavailable(), config=OperatorConfig()))
