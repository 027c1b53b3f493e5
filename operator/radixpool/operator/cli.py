"""`radixpool operator`: run the InferencePool operator (kopf), with peering and a liveness probe.

Two replicas never fight: each starts with a random kopf peering priority, and kopf pauses every
operator that sees a peer with a higher one, so exactly one works and another takes over when it
stops. The peering object is created at start-up when missing; when it cannot be, the operator
says why and exits 1 rather than wait silently. `--standalone` skips peering (one replica, no
peering objects).
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "operator", help="run the InferencePool operator",
        description="Watch InferencePool resources and keep their workers, gateway and status "
                    "as declared.")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", dest="namespaces", metavar="NS",
                       help="watch only this namespace (repeatable)")
    scope.add_argument("--all-namespaces", "-A", action="store_true",
                       help="watch every namespace (the default)")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then "
                                             "~/.kube/config)")
    parser.add_argument("--liveness", default="http://[::]:8081/healthz",
                        help="liveness endpoint URL; host [::]: every IPv6 and IPv4 address, "
                             "IPv4 only where IPv6 is off (default: %(default)s)")
    parser.add_argument("--peering", default="radixpool",
                        help="kopf peering object name (default: %(default)s)")
    parser.add_argument("--priority", type=int, default=None,
                        help="peering priority (default: random, so replicas differ)")
    parser.add_argument("--standalone", action="store_true", help="no peering: one replica only")
    parser.add_argument("--worker-image", help="worker image for pools that name none "
                                               "(default: $RADIXPOOL_WORKER_IMAGE)")
    parser.add_argument("--gateway-image", help="gateway image for pools that name none "
                                                "(default: $RADIXPOOL_GATEWAY_IMAGE)")
    parser.add_argument("--resync-seconds", type=float, default=15.0,
                        help="how often each pool is re-checked: drift healed, status refreshed "
                             "(default: %(default)s)")
    parser.add_argument("--network-policy", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="give each pool's workers a NetworkPolicy letting only its gateway "
                             "and Prometheus in (default: $RADIXPOOL_NETWORK_POLICY, else off)")
    parser.add_argument("--set-pod-uid", action=argparse.BooleanOptionalAction, default=None,
                        help="run pools' pods as uid, gid and fsGroup 1000 (the images' user); "
                             "--no-set-pod-uid leaves them unset for the platform to assign, as "
                             "OpenShift's restricted-v2 SCC requires (default: "
                             "$RADIXPOOL_SET_POD_UID, else on)")
    parser.add_argument("--verbose", action="store_true")
    parser.set_defaults(func=run_operator)


def run_operator(args: argparse.Namespace) -> int:
    import dataclasses
    import os

    import kopf
    from kubernetes.config import ConfigException

    from . import handlers, liveness  # registers the event handlers
    from .desired import OperatorConfig
    from .gate import PoolGate
    from .kube import KubeCluster, load_api_client
    from .peering import PeeringUnavailable, ensure_peering

    try:
        liveness.parse_endpoint(args.liveness)
        config = OperatorConfig.from_env()
    except ValueError as error:
        print(f"radixpool operator: {error}", file=sys.stderr)
        return 2
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig  # kopf's own login reads it too
    try:
        cluster = KubeCluster(load_api_client(args.kubeconfig))
    except ConfigException as error:
        print(f"radixpool operator: no Kubernetes credentials: {error}", file=sys.stderr)
        return 1

    if args.worker_image:
        config = dataclasses.replace(config, worker_image=args.worker_image)
    if args.gateway_image:
        config = dataclasses.replace(config, gateway_image=args.gateway_image)
    if args.network_policy is not None:
        config = dataclasses.replace(config, network_policy=args.network_policy)
    if args.set_pod_uid is not None:
        config = dataclasses.replace(config, set_pod_uid=args.set_pod_uid)
    if not args.standalone:
        try:
            for created in ensure_peering(cluster, args.peering, args.namespaces or ()):
                print(f"radixpool operator: created the peering object {created}",
                      file=sys.stderr)
        except PeeringUnavailable as error:
            print(f"radixpool operator: {error}", file=sys.stderr)
            return 1
    handlers.register_periodic_check(args.resync_seconds)
    liveness.register(args.liveness)   # kopf's own binds `::` IPv6-only (liveness.py)
    kopf.configure(verbose=args.verbose)
    if not args.verbose:
        logging.getLogger("kopf.objects").addFilter(handlers.QuietPeriodicSuccess())
    try:
        kopf.run(
            clusterwide=not args.namespaces,
            namespaces=args.namespaces or (),
            standalone=args.standalone,
            peering_name=None if args.standalone else args.peering,
            priority=args.priority if args.priority is not None
            else random.SystemRandom().randint(1, 2**31 - 1),
            memo=kopf.Memo(config=config, cluster=cluster, gone=set(), gate=PoolGate(
                base=args.resync_seconds, cap=handlers.MAX_BACKOFF_SECONDS)),
        )
    except Exception as error:  # kopf raises on login and API failures; say so and exit non-zero
        print(f"radixpool operator: stopped: {error}", file=sys.stderr)
        return 1
    return 0
