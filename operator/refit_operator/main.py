"""`refit-operator`: leader election, metrics endpoint, then kopf with our handlers."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from typing import Any

import kopf

from . import cluster, handlers, metrics, worker
from .engine import Engine
from .leader import Lease

log = logging.getLogger("refit_operator")


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
    p.add_argument("--lease-seconds", type=int, default=15)
    p.add_argument("--identity", default=os.environ.get("POD_NAME") or socket.gethostname())
    p.add_argument("--verbose", "-v", action="store_true")
    return p.parse_args(argv)


async def run(args: argparse.Namespace) -> int:
    global _connection
    api_client = await cluster.connect(args.kubeconfig)
    _connection = connection_info(api_client)
    if args.metrics_port:
        metrics.serve(args.metrics_port, args.metrics_addr)
    identity = f"{args.identity}-{os.getpid()}"
    lease = Lease(api_client, args.lease_namespace, args.lease_name, identity, args.lease_seconds)
    log.info("waiting for leadership as %s", identity)
    await lease.acquire()
    lost = asyncio.Event()  # set by the lease holder only
    stop = asyncio.Event()
    holder = asyncio.create_task(lease.hold(lost))
    async with worker.session() as http:
        engine = Engine(cluster.Cluster(api_client, identity), http)
        handlers.install(engine)
        kopf_task = asyncio.create_task(
            kopf.operator(
                standalone=True,
                clusterwide=not args.namespace,
                namespaces=args.namespace,
                stop_flag=stop,
            )
        )
        await asyncio.wait({kopf_task, holder}, return_when=asyncio.FIRST_COMPLETED)
        stop.set()
        await kopf_task
    holder.cancel()
    await api_client.close()
    if lost.is_set():
        log.error("leadership lost: exiting so that exactly one replica acts")
        return 1
    return 0


_connection: kopf.ConnectionInfo | None = None


@kopf.on.login()
def login(**_: object) -> kopf.ConnectionInfo | None:
    """kopf talks to the API server with the credentials our own client loaded."""
    return _connection


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
    # One line per HTTP request to a pod drowns the log of a large fleet.
    sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
