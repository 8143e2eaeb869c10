"""vLLM's trainer-side flow over ``refit-gloo``: ``WeightTransferTrainerFactory.trainer_init(
GlooTrainerInitInfo(...), client=..., source=...)`` for one server. The sending itself is
sender.Sender's; this module puts it behind vLLM's TrainerWeightTransferEngine interface (the
counterpart of gloo_engine on the workers) and needs vLLM where sender does not.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from refit_worker.broadcast.gloo_group import DEFAULT_TIMEOUT_SECONDS
from refit_worker.broadcast.packed_tensor import DEFAULT_BUCKET_BYTES
from refit_worker.broadcast.promise import build_manifest
from refit_worker.broadcast.sender import Sender
from refit_worker.contract import TRANSFER_BACKEND, TransferManifest


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = TRANSFER_BACKEND

    world_size: int  # the trainer + the server's workers
    master_address: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    extra: dict[str, Any] = field(default_factory=dict)  # more init info for the workers


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """vLLM's trainer-side flow over refit-gloo: ``trainer_init`` opens the rendezvous and
    initializes the server through ``client``; each ``send_weights`` builds the promise from
    the source, then start, update (concurrently with the broadcast), finish. The source is
    materialized once per round (the promise needs every tensor's bytes before they are
    sent). Multi-rank trainers: only rank 0 takes part."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, sender: Sender | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sender = sender
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
        if not init_info.is_sender:
            return cls(sender=None, client=client, source=source, is_sender=False)
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
        return cls(sender=sender, client=client, source=source)

    def send_weights(self) -> None:
        assert self.source is not None
        tensors = {name: t.detach().to("cpu") for name, t in self.source}
        if not self.is_sender:
            return
        assert self.sender is not None
        manifest = build_manifest(tensors)
        self.client.start_weight_update()
        with ThreadPoolExecutor(max_workers=1) as pool:
            update = pool.submit(self.client.update_weights, {"manifest": manifest.to_json_dict()})
            self.sender.send(tensors)
            update.result()  # the server's refusal, if any
        self.client.finish_weight_update()
        self.last_manifest = manifest

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
