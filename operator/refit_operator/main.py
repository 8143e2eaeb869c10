"""`refit-operator`: leader election, metrics endpoint, then kopf with our handlers."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import secrets
import socket
import sys
from typing import Any

import kopf

from . import handlers
from .controller.reconcile_loop import Engine
from .core import history
from .edges import cluster, metrics, worker_client
from .edges.leader import DEFAULT_LEASE_SECONDS, Lease, RenewalThread

log = logging.getLogger("refit_operator")

# CPython's default thresholds (700, 10, 10) run a young collection every 700 allocations and
# a full one, over every live object, every 100 of those. With a large fleet's pods in the
# watch cache and thousands of short-lived objects per pod call, those full collections made
# operator CPU per pod grow with the fleet: 5,000 simulated pods AllAtOnce took 71.8 s of CPU
# (83.8 s wall) by default, 39.4 s (51.3 s) with these. The price is memory: garbage waits
# longer for a collection, so RSS settles higher (the soak's 1,000 refits on 4 pods: +30 MiB
# from the first sample, +1.6 MiB over the last 250 refits; +13 and +0.4 by default).
# bench/results/HISTORY.md, 2026-12-07, has the settings tried.
GC_THRESHOLDS = (100_000, 50, 100)


def tune_gc() -> None:
    gc.set_threshold(*GC_THRESHOLDS)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="refit-operator", description=__doc__)
    p.add_argument(
        "--namespace", "-n", action="append", default=[],
        help="watch only this namespace (repeatable; default: cluster-wide)",
    )  # fmt: skip
    p.add_argument("--kubeconfig", default=None, help="default: in-cluster, else KUBECONFIG")
    p.add_argument("--metrics-port", type=int, default=8080, help="0 turns /metrics off")
    p.add_argument("--metrics-addr", default="0.0.0.0")
    p.add_argument("--lease-namespace", default=os.environ.get("POD_NAMESPACE", "default"))
    p.add_argument("--lease-name", default="refit-operator")
    p.add_argument("--lease-seconds", type=int, default=DEFAULT_LEASE_SECONDS)
    p.add_argument("--identity", default=os.environ.get("POD_NAME") or socket.gethostname())
    p.add_argument(
        "--history-limit", type=_non_negative_int, default=history.DEFAULT_HISTORY_LIMIT,
        help="finished WeightRefits kept per fleet, newest first; older ones are deleted "
        "(the fleet's newest Succeeded refit is always kept; 0 keeps only it; default: "
        "%(default)s)",
    )  # fmt: skip
    p.add_argument("--verbose", "-v", action="store_true")
    return p.parse_args(argv)


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def process_identity(base: str) -> str:
    """This process's name in the Lease, Events and pod claims: unique per process, not per
    pod (as client-go's leader election adds a UUID): a restarted container's operator has
    the same pod name and, as its image's entrypoint, pid 1 again."""
    return f"{base}-{os.getpid()}-{secrets.token_hex(3)}"


async def run(args: argparse.Namespace) -> int:
    api_client = await cluster.connect(args.kubeconfig)
    if args.metrics_port:
        metrics.serve(args.metrics_port, args.metrics_addr)
    identity = process_identity(args.identity)
    lease = Lease(api_client, args.lease_namespace, args.lease_name, identity, args.lease_seconds)
    log.info("waiting for leadership as %s", identity)
    await lease.acquire()
    stop = asyncio.Event()
    # Renewals run on a thread with a client of their own: neither the operator's work on
    # this loop nor thousands of pod writes queued on its connections can delay one.
    renewals = RenewalThread(lease, lambda: cluster.connect(args.kubeconfig))
    holder = asyncio.create_task(renewals.run())
    async with worker_client.session() as http:
        policy = history.Policy(args.history_limit)
        kube = cluster.Cluster(api_client, identity)
        engine = Engine(kube, http, lease, policy)
        await engine.sync(args.namespace or None)
        kopf_task = asyncio.create_task(
            kopf.operator(
                memo=handlers.memo(engine, connection_info(api_client)),
                standalone=True,
                clusterwide=not args.namespace,
                namespaces=args.namespace,
                stop_flag=stop,
            )
        )
        await asyncio.wait({kopf_task, holder}, return_when=asyncio.FIRST_COMPLETED)
        stop.set()
        await kopf_task
        await kube.close()
    holder.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await holder
    await api_client.close()
    if lease.lost.is_set():
        log.error("leadership lost: exiting so that exactly one replica acts")
        return 1
    return 0


def connection_info(api_client: Any) -> kopf.ConnectionInfo:
    cfg = api_client.configuration
    auth = (cfg.api_key or {}).get("authorization") or (cfg.api_key or {}).get("BearerToken")
    scheme, _, token = (auth or "").partition(" ")
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        scheme=scheme or None,
        token=token or None,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # kopf logs every watch event handled ("Handler 'refit_event' succeeded"): our own log
    # says what happened to each refit.
    if not args.verbose:
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    tune_gc()
    sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
