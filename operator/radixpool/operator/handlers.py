"""kopf handlers: a few lines each, all calling `reconcile_pool`.

create / update / resume apply the spec; a timer (`register_periodic_check`) re-runs the same
reconciliation so drift is put back and status follows the pods; delete needs no work because
every owned object carries an owner reference. kopf puts its finalizer on each pool for the
timer's sake and lifts it as soon as the pool is deleted, so delete pools before uninstalling the
operator (or clear `metadata.finalizers`). Importing this module registers the event handlers.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from . import api
from .reconcile import reconcile_pool

RESYNC_SECONDS = 15.0


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=api.GROUP)
    settings.persistence.finalizer = f"{api.GROUP}/finalizer"
    settings.posting.level = logging.WARNING
    # Watches reconnect regularly, so a silently dropped connection never stalls the operator.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30


@kopf.on.login()
def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    """kopf connects with the credentials the operator already loaded (`--kubeconfig`, in-cluster
    or ~/.kube/config), so kopf and the operator's own client never disagree on the cluster."""
    config = memo.cluster.api_client.configuration
    # Reading the key runs the client's refresh hook: rotated service-account tokens stay fresh.
    header = (config.get_api_key_with_prefix("BearerToken")
              or config.get_api_key_with_prefix("authorization") or "")
    scheme, _, token = header.partition(" ") if " " in header else ("", "", header)
    return kopf.ConnectionInfo(
        server=config.host, ca_path=config.ssl_ca_cert, insecure=not config.verify_ssl,
        username=config.username or None, password=config.password or None,
        scheme=scheme or None, token=token or None,
        certificate_path=config.cert_file, private_key_path=config.key_file)


def _reconcile(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo) -> None:
    try:
        outcome = reconcile_pool(dict(body), memo.cluster, memo.config)
    except ApiException as error:
        raise kopf.TemporaryError(f"Kubernetes API said {error.status} {error.reason}",
                                  delay=10) from error
    patch.status.update(outcome.status)
    for event in outcome.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)


@kopf.on.resume(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.create(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.update(api.GROUP, api.VERSION, api.PLURAL)
def apply_pool(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    _reconcile(body, patch, memo)


def check_pool(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    _reconcile(body, patch, memo)


def register_periodic_check(interval: float = RESYNC_SECONDS) -> None:
    """The timer that heals drift and refreshes status; its interval comes from the CLI."""
    kopf.timer(api.GROUP, api.VERSION, api.PLURAL, interval=interval,
               initial_delay=interval)(check_pool)


@kopf.on.delete(api.GROUP, api.VERSION, api.PLURAL, optional=True)
def pool_deleted(name: str, logger: kopf.Logger, **_: Any) -> None:
    logger.info("pool %s deleted; Kubernetes garbage-collects its owned objects", name)
