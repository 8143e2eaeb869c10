"""Refit as vLLM's ``VLLMWeightSyncClient``: a trainer that drives vLLM's trainer-side weight
transfer engine (``WeightTransferTrainerFactory.trainer_init(init_info, client=...,
source=...)``, then ``send_weights()``) passes this client instead of vLLM's HTTP client, and
each ``send_weights()`` refits the whole fleet through the operator, probe-gated:

    refits = RefitWeightSyncClient(RefitClient(), fleet_selector={"app": "rollout"}, timeout=600)
    engine = WeightTransferTrainerFactory.trainer_init(
        GlooTrainerInitInfo(rank=0, master_address=HOST, master_port=PORT),
        client=refits, source=ModuleSource(model))
    refits.prepare("step-100", reference)   # the next send's version and probe reference
    engine.send_weights()                   # RefitFailed / RefitTimeout: the fleet kept the last

The engine is refit-gloo's (refit_worker.broadcast.gloo_trainer), the one the operator's pods
receive: the client is its ``FleetWeightSyncClient``. vLLM's four calls map onto the
operator's handshake (docs/broadcast.md), through the same pieces as RefitClient.broadcast:

- ``init_weight_transfer_engine``: where the trainer's rendezvous will be (host, port) and
  its transfer timeout, for the refits' ``spec.broadcast``; the pods join per round, later;
- ``promise`` (the engine's, before start): the transfer manifest of the tensors to send;
- ``start_weight_update``: RefitClient.create_broadcast (the ConfigMap and the WeightRefit),
  then the wait for its first round's receivers (ReceiversReady);
- ``rounds``: each round's world size (the trainer + the round's pods' workers, the
  operator's), the first being start's; the engine opens that world's rendezvous per round;
- ``update_weights``: the announcement of the round (the pods then join and receive);
- ``finish_weight_update``: the probe-gated verdict; RefitFailed with the operator's reason
  on a failed refit, RefitTimeout when ``timeout`` passes first.

A vLLM engine that fixes its world at ``trainer_init`` (``nccl``: one group for the life of
the trainer) cannot follow the operator's rounds: the client refuses its init.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from refit_operator.core import api
from refit_worker.contract import ProbeReference, TransferManifest

from .client import BroadcastRounds, RefitClient
from .refit_document import default_name
from .refit_error import RefitError


class RefitWeightSyncClient:
    """vLLM's VLLMWeightSyncClient (and refit-gloo's FleetWeightSyncClient) for the fleet
    of ``fleet_selector``. ``timeout`` bounds each refit, from start to verdict; other
    keywords set the refits' spec fields as for RefitClient.submit (strategy,
    max_unavailable, port, admin_token_secret, sequence, on_failure, ...)."""

    def __init__(
        self,
        refits: RefitClient,
        *,
        fleet_selector: Mapping[str, str] | str | api.LabelSelector,
        timeout: float,
        namespace: str | None = None,
        on_update: Callable[[dict[str, Any]], None] | None = None,
        **spec: Any,
    ) -> None:
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        self.refits, self.fleet_selector, self.timeout = refits, fleet_selector, timeout
        self.namespace = namespace or refits.namespace
        self.on_update, self.spec = on_update, spec
        self._rendezvous: tuple[str, int] | None = None
        self._transfer_timeout: int | None = None
        self._next: tuple[str, ProbeReference | Mapping[str, Any] | Path, str | None] | None = None
        self._manifest: TransferManifest | None = None
        self._rounds: BroadcastRounds | None = None
        self._ready: Iterator[tuple[int, int]] | None = None
        self._first: tuple[int, int] | None = None
        self._round = 0
        self.name = ""  # the current (or last) refit's
        self.version = ""
        self.last_status: dict[str, Any] | None = None  # the last Succeeded refit's

    def prepare(
        self,
        version: str,
        reference: ProbeReference | Mapping[str, Any] | Path,
        *,
        name: str | None = None,
    ) -> None:
        """The version and probe reference of the next ``send_weights`` (the probe judges the
        pods against ``reference`` before they serve ``version``); ``name``: the refit's,
        ``refit-<version>`` by default."""
        self._next = (version, reference, name)

    # ------------------------------------------------------------- the engine's calls
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        if "world_size" in init_info or "rank_offset" in init_info:
            raise RefitError(
                "this engine fixes one world at trainer_init; a fleet's worlds are the "
                "operator's rounds (one per batch of pods), which the refit-gloo trainer "
                "engine (GlooTrainerInitInfo) follows"
            )
        try:
            self._rendezvous = (str(init_info["master_address"]), int(init_info["master_port"]))
        except (KeyError, TypeError, ValueError) as e:
            raise RefitError(f"init info without a rendezvous: {init_info!r}") from e
        if "timeout_seconds" in init_info:
            self._transfer_timeout = max(1, round(float(init_info["timeout_seconds"])))

    def promise(self, manifest: TransferManifest) -> None:
        self._manifest = manifest

    def start_weight_update(self) -> None:
        if self._rendezvous is None:
            raise RefitError("start_weight_update before init_weight_transfer_engine")
        if self._next is None:
            raise RefitError("call prepare(version, reference) before each send_weights")
        if self._manifest is None:
            raise RefitError(
                "no promise from the engine: the operator's pods receive refit-gloo rounds "
                "only (GlooTrainerInitInfo)"
            )
        version, reference, name = self._next
        self._next = None
        self.name = self.refits.create_broadcast(
            self._manifest, version, fleet_selector=self.fleet_selector,
            rendezvous=self._rendezvous, reference=reference, namespace=self.namespace,
            name=name or default_name(version), transfer_timeout_seconds=self._transfer_timeout,
            **self.spec,
        )  # fmt: skip
        self.version = version
        self._rounds = BroadcastRounds(
            self.refits, self.name, self.namespace, self.timeout, self.on_update
        )
        self._ready = iter(self._rounds)
        self._first = next(self._ready, None)  # None: the refit ended before any round

    def rounds(self) -> Iterator[int]:
        if self._ready is None:
            raise RefitError("rounds before start_weight_update")
        ready = self._first
        self._first = None
        while ready is not None:
            self._round = ready[0]
            yield ready[1]
            ready = next(self._ready, None)

    def update_weights(self, update_info: Mapping[str, Any] | list[Any]) -> None:
        if self._rounds is None or not self._round:
            raise RefitError("update_weights outside a round")
        sent = update_info.get("manifest") if isinstance(update_info, Mapping) else None
        if self._manifest is None or (sent or {}).get("blake3") != self._manifest.digest:
            raise RefitError("update_weights with another promise than the refit pins")
        self._rounds.announce(self._round)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if self._rounds is None:
            raise RefitError("finish_weight_update before start_weight_update")
        if weight_version is not None and weight_version != self.version:
            raise RefitError(f"finish at {weight_version!r}: the refit is of {self.version!r}")
        rounds, self._rounds, self._ready, self._manifest, self._round = (
            self._rounds, None, None, None, 0
        )  # fmt: skip
        self.last_status = rounds.verdict()  # RefitFailed / RefitTimeout
