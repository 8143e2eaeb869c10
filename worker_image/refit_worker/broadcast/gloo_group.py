"""The transfer's gloo process group: one rank's membership, over TCP.

The world: rank 0 is the trainer (the only sender), ranks 1..world_size-1 are inference
workers, one per vLLM worker process (a pod with tensor parallelism 2 is two ranks). The
trainer opens the rendezvous, a TCPStore server at host:port (sender.Sender); every rank joins
one gloo process group through it, never torch.distributed's default group (vLLM uses that one
for its own workers). gloo connects every pair of ranks, each on the address of its route to
the trainer. Torch only.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

import torch

from refit_worker.broadcast.packed_tensor import TransportError

DEFAULT_TIMEOUT_SECONDS = 600.0
_STORE_PREFIX = "refit-gloo"


def address_towards(host: str, port: int) -> str:
    """This machine's address on the route to host (no packet is sent): the address the
    other ranks can reach this one at, without trusting the hostname's resolution."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])


class Group:
    """One rank's membership of the transfer's gloo process group. The group is made from a
    TCPStore of its own and never touches torch.distributed's default group, which vLLM uses
    for its own workers."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        *,
        local_address: str | None = None,
        store: Any = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world of {world_size}")
        timeout = datetime.timedelta(seconds=timeout_seconds)
        if store is None:  # a receiver: connect to the trainer's store (retried until timeout)
            store = torch.distributed.TCPStore(host, port, world_size, False, timeout=timeout)
        self.store = store
        self.rank, self.world_size = rank, world_size
        # An explicit device: gloo's default resolves the hostname, which in a container may
        # name an address the other ranks cannot reach (or 127.0.1.1).
        pg_gloo: Any = torch.distributed.ProcessGroupGloo  # _Options is not in the stubs
        options = pg_gloo._Options()
        options._timeout = timeout
        options._devices = [
            pg_gloo.create_device(hostname=local_address or address_towards(host, port))
        ]
        prefixed = torch.distributed.PrefixStore(_STORE_PREFIX, store)
        self.pg: Any = pg_gloo(prefixed, rank, world_size, options)  # waits for every rank

    def broadcast(self, tensor: torch.Tensor) -> None:
        options = torch.distributed.BroadcastOptions()
        options.rootRank = 0
        try:
            self.pg.broadcast([tensor], options).wait()
        except RuntimeError as exc:  # gloo reports timeouts and lost peers this way
            raise TransportError(f"gloo broadcast failed: {exc}") from exc

    def close(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except RuntimeError:
                pass  # already broken; dropping it is all that is left
