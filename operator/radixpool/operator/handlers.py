"""kopf handlers: a few lines each, all calling `reconcile_pool`.

create / update / resume apply the spec; a timer (`register_periodic_check`) re-runs the same
reconciliation so drift is put back and status follows the pods. No handler needs a finalizer:
every owned object carries an owner reference, so deleting a pool needs no operator (Kubernetes
garbage-collects what it owned), with or without a running operator. The timer is registered
without kopf's finalizer, and kopf lifts the one older versions put on pools. Without a finalizer
kopf does not stop a deleted pool's timer (the pool vanishes at once, never "being deleted"), so
the timer first checks the pool still exists: else it would make the pool's objects again and
again, each removed at once by garbage collection. One pass per pool at
a time, with backoff after API errors (`gate.PoolGate`); status is written only when it changed,
and Events come from `radixpool-operator`. Importing this module registers the event handlers.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import kopf

from . import api
from .desired import ObjectRef
from .diffbase import DigestDiffBaseStorage
from .gate import PoolGate
from .reconcile import ApiFailure, reconcile_pool

RESYNC_SECONDS = 15.0
MAX_BACKOFF_SECONDS = 300.0


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api.GROUP)
    settings.persistence.diffbase_storage = DigestDiffBaseStorage(prefix=api.GROUP)
    settings.persistence.finalizer = f"{api.GROUP}/finalizer"  # only ever removed now
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


def _gate(memo: kopf.Memo) -> PoolGate:
    return memo.setdefault("gate", PoolGate(RESYNC_SECONDS, MAX_BACKOFF_SECONDS))


def _reconcile(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: logging.Logger,
               *, periodic: bool) -> None:
    meta = body["metadata"]
    if meta.get("deletionTimestamp"):
        return  # going away: garbage collection removes what it owned
    key, gate = meta.get("uid") or f"{meta.get('namespace')}/{meta['name']}", _gate(memo)
    with gate.turn(key, wait=not periodic) as mine:
        if not mine or (periodic and not gate.due(key)):
            return
        if periodic and _gone(meta, memo, logger):
            return
        outcome = reconcile_pool(dict(body), memo.cluster, memo.config,
                                 retry_in=gate.next_delay(key))
        if outcome.failure:
            delay = gate.failed(key)
            logger.warning("pool %s/%s: %s; next attempt in %.0fs", meta.get("namespace"),
                           meta["name"], outcome.failure, delay)
        else:
            gate.succeeded(key)
        before = dict(body.get("status") or {})
        if outcome.status != before:
            patch.status.update(outcome.status)
            for gone in before.keys() - outcome.status.keys():
                patch.status[gone] = None
        for event in outcome.events:
            try:
                memo.cluster.post_event(dict(body), event)
            except Exception as error:  # an Event lost must not stop the reconciliation
                logger.warning("could not post event %s: %s", event.reason, error)


def _gone(meta: dict[str, Any], memo: kopf.Memo, logger: logging.Logger) -> bool:
    """Whether the pool no longer exists (or another of the same name replaced it). Once gone,
    always gone: its timer (which kopf never stops) then costs no request at all."""
    gone: set[str] = memo.setdefault("gone", set())
    if meta.get("uid") in gone:
        return True
    ref = ObjectRef(api.API_VERSION, api.KIND, meta.get("namespace", "default"), meta["name"])
    try:
        current = memo.cluster.get(ref)
    except ApiFailure as failure:  # cannot tell: reconcile, which reports the API's trouble
        logger.warning("could not read pool %s/%s: %s", ref.namespace, ref.name, failure)
        return False
    if current is None or current["metadata"].get("uid") != meta.get("uid"):
        gone.add(meta.get("uid", ""))
        return True
    return False


@kopf.on.resume(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.create(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.update(api.GROUP, api.VERSION, api.PLURAL)
def apply_pool(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo,
               logger: logging.Logger = logging.getLogger(__name__), **_: Any) -> None:
    _reconcile(body, patch, memo, logger, periodic=False)


def check_pool(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo,
               logger: logging.Logger = logging.getLogger(__name__), **_: Any) -> None:
    _reconcile(body, patch, memo, logger, periodic=True)


class QuietPeriodicSuccess(logging.Filter):
    """Drops kopf's INFO line for each successful run of the periodic check: one per pool every
    resync (15 s), four fifths of the log, saying nothing (a failing pass logs a warning)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.INFO
                    and record.getMessage() == f"Timer {check_pool.__name__!r} succeeded.")


def register_periodic_check(interval: float = RESYNC_SECONDS,
                            registry: kopf.OperatorRegistry | None = None) -> None:
    """The timer that heals drift and refreshes status; its interval comes from the CLI.

    kopf gives every timer a finalizer, which would keep a deleted pool (and its namespace)
    waiting for a running operator. This timer needs none: the registered handler is replaced by
    the same one without it (kopf then stops the timer when it sees the pool deleted)."""
    registry = registry or kopf.get_default_registry()
    kopf.timer(api.GROUP, api.VERSION, api.PLURAL, interval=interval, initial_delay=interval,
               registry=registry)(check_pool)
    spawning = registry._spawning._handlers
    for index, handler in enumerate(spawning):
        if handler.fn is check_pool:
            spawning[index] = dataclasses.replace(handler, requires_finalizer=False)
