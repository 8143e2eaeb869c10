"""vLLM's trainer-side flow over ``refit-gloo``: ``WeightTransferTrainerFactory.trainer_init(
GlooTrainerInitInfo(...), client=..., source=...)``, for one server (a client that calls its
RL routes) or a whole fleet through the operator (a ``FleetWeightSyncClient``:
refit_client.weight_sync.RefitWeightSyncClient). The sending itself is sender.Sender's; this
module puts it behind vLLM's TrainerWeightTransferEngine interface (the counterpart of
gloo_engine on the workers) and needs vLLM where sender does not.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, Self, runtime_checkable

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from refit_worker.broadcast.gloo_group import DEFAULT_TIMEOUT_SECONDS
from refit_worker.broadcast.packed_tensor import DEFAULT_BUCKET_BYTES, TransportError
from refit_worker.broadcast.promise import build_manifest
from refit_worker.broadcast.sender import Sender
from refit_worker.contract import TRANSFER_BACKEND, TransferManifest

log = logging.getLogger(__name__)


@runtime_checkable
class FleetWeightSyncClient(VLLMWeightSyncClient, Protocol):
    """A client that refits a fleet through the operator instead of calling one server: the
    pods' own calls are the operator's, in rounds, each with a rendezvous and a world of its
    own (docs/broadcast.md, "Rounds and ranks"). What the engine needs beyond vLLM's four
    methods: to hand over the promise before ``start_weight_update`` (the refit pins its
    digest), and each round's world size as its receivers become ready; its
    ``update_weights`` announces the round and returns without waiting for the pods."""

    def promise(self, manifest: TransferManifest) -> None: ...

    def rounds(self) -> Iterator[int]: ...


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = TRANSFER_BACKEND

    # The trainer + the server's workers; 0 with a FleetWeightSyncClient, whose worlds are
    # the operator's rounds'.
    world_size: int = 0
    master_address: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port (one server only: a fleet's refits pin the port)
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    extra: dict[str, Any] = field(default_factory=dict)  # more init info for the workers


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """vLLM's trainer-side flow over refit-gloo. One server: ``trainer_init`` opens the
    rendezvous and initializes the server through ``client``; each ``send_weights`` builds
    the promise from the source, then start, update (concurrently with the broadcast),
    finish. A fleet (``FleetWeightSyncClient``): ``trainer_init`` tells the client where the
    rendezvous will be; each ``send_weights`` hands it the promise, then start (the refit),
    for every round a rendezvous of the round's world and update (the announcement)
    concurrently with the broadcast, then finish (the verdict). The source is materialized
    once per send (the promise needs every tensor's bytes before they are sent).
    Multi-rank trainers: only rank 0 takes part."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(
        self, *, sender: Sender | None, init_info: GlooTrainerInitInfo, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.sender = sender
        self.init_info = init_info
        self.last_manifest: TransferManifest | None = None

    @classmethod
    def trainer_init(
        cls,
        init_info: GlooTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if source is None:
            raise ValueError("refit-gloo needs a WeightSource")
        made: dict[str, Any] = {"init_info": init_info, "client": client, "source": source}
        if not init_info.is_sender:
            return cls(sender=None, is_sender=False, **made)
        if isinstance(client, FleetWeightSyncClient):
            if init_info.world_size or not init_info.master_port:
                raise ValueError(
                    "a fleet's world size is each round's (the operator's) and its refits pin "
                    "the rendezvous: leave world_size 0 and give a master_port, "
                    f"not world_size={init_info.world_size} master_port={init_info.master_port}"
                )
            client.init_weight_transfer_engine(
                {
                    "master_address": init_info.master_address,
                    "master_port": init_info.master_port,
                    "timeout_seconds": init_info.timeout_seconds,
                    **init_info.extra,
                }
            )
            return cls(sender=None, **made)
        if init_info.world_size < 2:
            raise ValueError(
                "one server's world is the trainer + the server's workers: world_size >= 2, "
                f"not {init_info.world_size}"
            )
        sender = Sender(
            init_info.world_size,
            host=init_info.master_address,
            port=init_info.master_port,
            timeout_seconds=init_info.timeout_seconds,
            bucket_bytes=init_info.bucket_bytes,
        )
        with ThreadPoolExecutor(max_workers=1) as pool:  # both sides wait for each other
            joined = pool.submit(
                client.init_weight_transfer_engine, sender.init_info(1, **init_info.extra)
            )
            sender.connect()
            joined.result()
        return cls(sender=sender, **made)

    def send_weights(self) -> None:
        assert self.source is not None
        tensors = {name: t.detach().to("cpu") for name, t in self.source}
        if not self.is_sender:
            return
        manifest = build_manifest(tensors)
        if isinstance(self.client, FleetWeightSyncClient):
            self._send_to_fleet(self.client, tensors, manifest)
        else:
            assert self.sender is not None
            self.client.start_weight_update()
            self._update(self.sender, tensors, manifest)
            self.client.finish_weight_update()
        self.last_manifest = manifest

    def _send_to_fleet(
        self,
        client: FleetWeightSyncClient,
        tensors: Mapping[str, torch.Tensor],
        manifest: TransferManifest,
    ) -> None:
        info = self.init_info
        client.promise(manifest)
        client.start_weight_update()
        for world in client.rounds():
            try:
                with Sender(world, host=info.master_address, port=info.master_port,
                            timeout_seconds=info.timeout_seconds,
                            bucket_bytes=info.bucket_bytes) as sender:  # fmt: skip
                    # The announcement: the operator then has the round's pods join and
                    # receive; the call does not wait for them.
                    client.update_weights({"manifest": manifest.to_json_dict()})
                    sender.send(tensors)
            except (TransportError, RuntimeError, OSError) as e:
                # The pods' receive fails too: the operator ends their passes, and finish
                # raises the refit's verdict, which says what happened to the fleet.
                log.warning("a round's send failed: %s", e)
        client.finish_weight_update()

    def _update(
        self, sender: Sender, tensors: Mapping[str, torch.Tensor], manifest: TransferManifest
    ) -> None:
        with ThreadPoolExecutor(max_workers=1) as pool:
            update = pool.submit(self.client.update_weights, {"manifest": manifest.to_json_dict()})
            sender.send(tensors)
            update.result()  # the server's refusal, if any

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
