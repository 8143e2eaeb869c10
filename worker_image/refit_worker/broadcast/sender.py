"""The trainer's end of a broadcast refit: rank 0, the only sender. Torch only, no vLLM: a
trainer imports it as is (gloo_trainer puts it behind vLLM's trainer-side engine interface).
"""

from __future__ import annotations

import datetime
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from refit_worker.broadcast.gloo_group import DEFAULT_TIMEOUT_SECONDS, Group
from refit_worker.broadcast.packed_tensor import DEFAULT_BUCKET_BYTES, send_round
from refit_worker.checkpoint.safetensors_header import safetensors_files


@dataclass(frozen=True)
class SendStats:
    tensors: int
    bytes: int
    buckets: int
    seconds: float

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "tensors": self.tensors,
            "bytes": self.bytes,
            "buckets": self.buckets,
            "seconds": round(self.seconds, 4),
        }


class Sender:
    """The trainer's end: rank 0 of the transfer's world.

    ``Sender(world_size, host=, port=)`` opens the rendezvous at once (port 0: a free one,
    see ``.port``), ``init_info(rank_offset)`` is the body a pod's
    ``/init_weight_transfer_engine`` takes, ``connect()`` waits until every receiver has
    joined (call it while the pods' init calls are in flight: they wait for it too), and
    each ``send(tensors)`` is one round; the pods must be inside ``/update_weights`` for it.
    """

    def __init__(
        self,
        world_size: int,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        if world_size < 2:
            raise ValueError("a broadcast needs at least one receiver (world_size >= 2)")
        self.host, self.world_size = host, world_size
        self.timeout_seconds, self.bucket_bytes = timeout_seconds, bucket_bytes
        # Bind the socket ourselves: the store listens on exactly this address (not on every
        # interface) and a free port is taken without a race. The store owns the socket's
        # descriptor from then on (it closes it when it goes).
        listen = socket.create_server((host, port))
        self.port = int(listen.getsockname()[1])
        try:
            self._store: torch.distributed.TCPStore | None = torch.distributed.TCPStore(
                host,
                self.port,
                world_size,
                True,
                timeout=datetime.timedelta(seconds=timeout_seconds),
                wait_for_workers=False,
                master_listen_fd=listen.fileno(),
            )
        except BaseException:
            listen.close()
            raise
        listen.detach()
        self.group: Group | None = None

    def init_info(self, rank_offset: int, **extra: Any) -> dict[str, Any]:
        """The refit-gloo init info for a pod whose first worker is rank `rank_offset`."""
        return {
            "master_address": self.host,
            "master_port": self.port,
            "rank_offset": rank_offset,
            "world_size": self.world_size,
            "timeout_seconds": self.timeout_seconds,
            **extra,
        }

    def connect(self) -> None:
        if self.group is None:
            self.group = Group(
                self.host, self.port, 0, self.world_size, self.timeout_seconds, store=self._store
            )

    def send(
        self, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> SendStats:
        """One round: the header, then every tensor's bytes, bucketed (packed_tensor)."""
        self.connect()
        assert self.group is not None
        started = time.perf_counter()
        items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
        total, buckets = send_round(self.group, items, self.bucket_bytes)
        return SendStats(len(items), total, buckets, time.perf_counter() - started)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self._store = None  # its server (and the listening socket) go with it

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a directory of safetensors shards (a checkpoint), on the CPU."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for shard in safetensors_files(Path(directory)):
        tensors.update(load_file(str(shard)))
    return tensors


def model_tensors(model: Any) -> dict[str, torch.Tensor]:
    """A model's tensors in memory under its checkpoint names, ready to send (a tied output
    head is not a tensor of its own in the checkpoint)."""
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state
