"""The ``refit-gloo`` weight transfer engine: broadcast refits through vLLM's own RL API.

vLLM's RL router (VLLM_SERVER_DEV_MODE=1) drives pluggable weight transfer engines:
``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``. Its built-in engines need CUDA (nccl, sparse_nccl, nccl_m2n: NCCL;
ipc: CUDA IPC handles), Ray with NIXL (sharded_rdt) or an external service (modelexpress), so
none of them runs on a CPU worker. This engine moves the weights with torch.distributed's gloo
backend (gloo_group, packed_tensor) and adds what the built-ins lack: the update carries the
trainer's promise (a contract.TransferManifest) and nothing reaches the model unless what
arrived is exactly that.

A round, on each receiving worker:

- ``init_transfer_engine``: join the trainer's gloo group at rank ``rank_offset`` + this
  worker's rank across data parallelism (vLLM's NCCL engine numbers its workers the same way).
- ``start_weight_update``: a new round; the model is not touched.
- ``update_weights({"manifest": ...})``: parse the promise and check it against the model
  (every parameter the model loads, shapes and dtypes: the file path's TensorMismatch check);
  receive the whole round, hashing each tensor as it arrives and holding only those that match
  the promise; then, if the round is exactly the promise, load it with vLLM's layerwise reload.
  Any refusal drains the wire first (the other receivers and the trainer go on), then raises
  contract.RefitRejected, which vLLM's worker answers by ending the update: the model was
  never touched and keeps its weights.
- An engine running a ``draft_model`` drafter (refit_worker.drafter) loads the drafter's
  tensors of the same round (contract.DRAFTER_PREFIX) into it right after the target, as a
  checkpoint refit loads ``drafter/``; a promise without them is refused DrafterMissing, and
  one with them into an engine without a drafter TensorMismatch, both before the wire.
- ``finish_weight_update``: nothing left to do (the load ran in update_weights, where a
  failure ends the update cleanly; vLLM leaves an update open when finish raises).

The round's record is read back with the worker extension's RPC ``refit_received`` (HTTP
answers of the router carry no refusal code). One ``/update_weights`` per update: a second
one in the same update is drained and refused.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from refit_worker import peers
from refit_worker.broadcast.gloo_group import DEFAULT_TIMEOUT_SECONDS, Group
from refit_worker.broadcast.packed_tensor import TransportError, receive
from refit_worker.broadcast.promise import Verifier
from refit_worker.contract import (
    DRAFTER_PREFIX,
    ContractError,
    ManifestTensor,
    RefitRejected,
    TransferManifest,
    TransferTensor,
)
from refit_worker.drafter import REFITTED_METHODS, Drafter, method_of, reload_drafter
from refit_worker.model_tensors import LoadRules, verify_model_tensors
from refit_worker.transfer_manifest import parse_manifest, split_drafter

log = logging.getLogger("refit_worker.broadcast.gloo_engine")


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """``/init_weight_transfer_engine`` body's ``init_info`` (sender.Sender.init_info)."""

    master_address: str  # the trainer's rendezvous (its TCPStore)
    master_port: int
    rank_offset: int  # rank of this pod's first worker; the trainer is rank 0
    world_size: int  # the trainer + every receiving worker of every pod
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS  # per gloo operation
    local_address: str | None = None  # this worker's address for gloo; default: the route's


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """``/update_weights`` body's ``update_info``: the promise for this round."""

    manifest: Any = None  # contract.TransferManifest as JSON; checked in receive_weights


@dataclass
class Round:
    number: int
    state: str = "started"  # started -> loaded | refused
    code: str = ""
    detail: str = ""
    promised: str = ""  # the promise's digest ("" when there was no valid promise)
    received: TransferManifest | None = None
    bytes: int = 0
    receive_seconds: float = 0.0
    load_seconds: float = 0.0
    finished: bool = False

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "round": self.number,
            "state": self.state,
            "digest": self.received.digest if self.received else "",
            "promisedDigest": self.promised,
            "tensors": len(self.received.tensors) if self.received else 0,
            "bytes": self.bytes,
            "receiveSeconds": round(self.receive_seconds, 4),
            "loadSeconds": round(self.load_seconds, 4),
            "finished": self.finished,
            "manifest": self.received.to_json_dict() if self.received else None,
        }


def _expected(tensors: Iterable[tuple[str, TransferTensor]]) -> dict[str, ManifestTensor]:
    """Promised tensors as verify_model_tensors takes a checkpoint's."""
    return {n: ManifestTensor("(broadcast)", t.dtype, t.shape) for n, t in tensors}


def _drain(held: deque[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    while held:  # each tensor is released once the model took it
        yield held.popleft()


def _worker_rank(parallel_config: Any) -> int:
    """This worker's rank among every inference worker (as vLLM's NCCL engine counts)."""
    per_dp = parallel_config.world_size  # TP * PP
    return int(parallel_config.data_parallel_index * per_dp + parallel_config.rank)


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False
    # The drafter this worker refits with its target, or None. The engine is handed only the
    # target model; the worker extension, which reaches the model runner, sets this when vLLM
    # makes the engine (RefitWorkerExtension.weight_transfer_engine).
    find_drafter: Callable[[], Drafter | None] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Group | None = None
        self.rank, self.world_size = 0, 0  # this worker's place in the last group it joined
        self.round: Round | None = None
        self._rounds = 0

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()  # a new trainer (or a retry) replaces the old group
        rank = init_info.rank_offset + _worker_rank(self.parallel_config)
        where = f"rank {rank} of {init_info.world_size} at {init_info.master_address}:"
        where += str(init_info.master_port)
        if not 0 < rank < init_info.world_size:  # rank 0 is the trainer
            raise RefitRejected("TransferFailed", f"{where}: not a receiver's rank")
        try:
            self.group = Group(
                init_info.master_address,
                init_info.master_port,
                rank,
                init_info.world_size,
                init_info.timeout_seconds,
                local_address=init_info.local_address,
            )
        except (RuntimeError, OSError, ValueError) as exc:  # torch's store and gloo errors
            raise RefitRejected("TransferFailed", f"joining {where} failed: {exc}") from exc
        self.rank, self.world_size = rank, init_info.world_size
        log.info("refit-gloo: joined as %s", where)

    def start_weight_update(self) -> None:
        self._rounds += 1
        self.round = Round(self._rounds)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # Not the base class's: it parses strictly (a malformed promise must still drain the
        # wire) and synchronizes an accelerator, which a CPU worker does not have.
        manifest = update_info.get("manifest") if isinstance(update_info, dict) else None
        self.receive_weights(GlooUpdateInfo(manifest=manifest))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        current = self.round
        if current is None:  # vLLM's worker refuses update_weights before start already
            raise RuntimeError("start_weight_update must come first")
        problem: RefitRejected | None
        if current.state != "started":  # the update's one round was received already
            current = self.round = Round(current.number)
            promise = None
            problem = RefitRejected("TransferFailed", "a second update_weights in one update")
        else:
            promise, problem = self._check_promise(current, update_info.manifest)
        verifier = Verifier(promise)
        held: deque[tuple[str, torch.Tensor]] = deque()
        started = time.perf_counter()
        if self.group is None:  # nothing to receive from; refused with the peers below
            problem = RefitRejected(
                "TransferFailed", "not initialized: init_weight_transfer_engine"
            )
        else:
            try:
                for name, tensor in receive(self.group):
                    if verifier.check(name, tensor):  # hashed and compared as it arrives
                        held.append((name, tensor))
            except TransportError as exc:
                self.shutdown()  # a broken collective cannot be resumed: init again
                problem = RefitRejected(
                    "TransferFailed", f"{exc} (after {len(verifier.received)} tensors)"
                )
        current.receive_seconds = time.perf_counter() - started
        current.received, current.bytes = verifier.manifest(), verifier.bytes
        if problem is None and (mismatch := verifier.refusal()) is not None:
            problem = RefitRejected("TransferMismatch", mismatch)
        # One worker's refusal refuses every worker of the pod before any loads, and only the
        # answering worker raises it (refit_worker.peers); so again after the load.
        refusal = peers.exchange(problem)
        if refusal is None:
            try:
                self._load(current, held)
            except RefitRejected as exc:
                refusal = exc
            refusal = peers.exchange(refusal)
        held.clear()
        if refusal is not None:
            code = refusal.code if isinstance(refusal, RefitRejected) else "LoadFailed"
            detail = refusal.detail if isinstance(refusal, RefitRejected) else str(refusal)
            if current.state != "refused":
                self._record_refusal(current, code, detail)
            if peers.answering():
                raise refusal

    def _check_promise(
        self, current: Round, doc: Any
    ) -> tuple[TransferManifest | None, RefitRejected | None]:
        """Parse the promise and check that it fits the model and its drafter, if the
        engine runs one: (promise, refusal)."""
        try:
            promise = parse_manifest(doc)
        except ContractError as exc:
            return None, RefitRejected("ManifestInvalid", str(exc))
        current.promised = promise.digest
        target, drafted = split_drafter(promise.tensors.items())
        try:
            drafter = self._drafter_for(len(drafted))
            verify_model_tensors(self.model, _expected(target), LoadRules.of(self.vllm_config))
            if drafter is not None:
                verify_model_tensors(
                    drafter.model, _expected(drafted), LoadRules.of(drafter.config)
                )
        except RefitRejected as exc:
            return None, exc
        return promise, None

    def _drafter_for(self, drafted: int) -> Drafter | None:
        """The drafter the round's `drafted` drafter tensors load into (None: the engine runs
        none). Target and drafter load together or not at all: a promise without drafter
        tensors would serve a new target beside a stale drafter (DrafterMissing), and one
        with them has nothing to load them into here (TensorMismatch)."""
        if method_of(self.vllm_config) not in REFITTED_METHODS:
            if drafted:
                raise RefitRejected(
                    "TensorMismatch",
                    f"the promise carries {drafted} drafter tensors ({DRAFTER_PREFIX}…) and "
                    "this engine runs no draft_model drafter",
                )
            return None
        if not drafted:
            raise RefitRejected(
                "DrafterMissing",
                "this engine runs a draft_model drafter and the broadcast carries no drafter "
                f"tensors: send the drafter's too, named {DRAFTER_PREFIX}<its tensor name>",
            )
        drafter = self.find_drafter() if self.find_drafter is not None else None
        if drafter is None:  # no worker extension, or a runner without its draft model
            raise RefitRejected(
                "DrafterMissing",
                "this engine runs a draft_model drafter the worker cannot reach: serve with "
                "--worker-extension-cls refit_worker.extension.RefitWorkerExtension",
            )
        return drafter

    def _load(self, current: Round, held: deque[tuple[str, torch.Tensor]]) -> None:
        """vLLM's layerwise reload from the verified tensors (as its NCCL engine loads, but
        only after the whole round matched the promise); then the drafter's, if the round
        carries them (checked to fit the engine's drafter in _check_promise)."""
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        split = split_drafter(held)
        held.clear()
        target, drafted = deque(split[0]), deque(split[1])
        del split  # its lists hold every tensor: each is to be released once loaded
        drafter = self._drafter_for(len(drafted))
        model: Any = self.model
        started = time.perf_counter()
        try:
            with disable_mtp_completeness_check():
                initialize_layerwise_reload(model)
                try:
                    model.load_weights(_drain(target))
                finally:  # restores the layers that got nothing
                    finalize_layerwise_reload(model, self.model_config)
            if drafter is not None:  # as refit_load loads drafter/: right after the target
                reload_drafter(self.vllm_config, drafter, weights_iterator=_drain(drafted))
        except Exception as exc:
            self._refuse(current, "LoadFailed", f"{type(exc).__name__}: {exc}")
        current.load_seconds = time.perf_counter() - started
        current.state = "loaded"
        log.info(
            "refit-gloo: round %d loaded %s (%d tensors, %d bytes; received in %.3f s, "
            "loaded in %.3f s)",
            current.number,
            current.promised,
            len(current.received.tensors) if current.received else 0,
            current.bytes,
            current.receive_seconds,
            current.load_seconds,
        )

    def _refuse(self, current: Round, code: str, detail: str) -> None:
        self._record_refusal(current, code, detail)
        raise RefitRejected(code, detail)

    def _record_refusal(self, current: Round, code: str, detail: str) -> None:
        current.state, current.code, current.detail = "refused", code, detail
        log.warning("refit-gloo: round %d refused: %s: %s", current.number, code, detail)

    def finish_weight_update(self) -> None:
        if self.round is not None:
            self.round.finished = True

    def received(self, digest: str = "") -> dict[str, Any]:
        """The last round's record (refit_received); its refusal raised again, and
        TransferMismatch when it loaded weights other than `digest` (when given)."""
        current = self.round
        if current is None:
            raise RefitRejected("TransferFailed", "no broadcast received since the engine started")
        if current.state == "refused":
            raise RefitRejected(current.code, current.detail)
        if current.state != "loaded":
            raise RefitRejected("TransferFailed", f"round {current.number} received nothing yet")
        assert current.received is not None
        if digest and digest != current.received.digest:
            raise RefitRejected(
                "TransferMismatch",
                f"round {current.number} loaded {current.received.digest}, not {digest}",
            )
        return {**current.to_json_dict(), "rank": self.rank, "worldSize": self.world_size}

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
