"""vLLM's RL weight-transfer routes with the ``refit-gloo`` engine, as a broadcast refit's
receive calls them (refit_worker.broadcast.gloo_engine holds the real engine):
``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update`` and the extension's RPC ``refit_received``. The handlers are methods
of :class:`TransferRoutes`, a part of SimServer.

The wire is simulated in process: a trainer (testbed/explorer/trainer.py, on the explorer's
clock) opens a :class:`Rendezvous` at its (host, port) with ``SimServer.open_rendezvous``,
then sends the round's tensors, each a seed of the simulated model (``sim_transfer_manifest``
makes the promise of them), or dies. A pod joins the rendezvous open at the init's address
(waiting up to the init's ``timeout_seconds`` for the trainer to open it), receives in
``/update_weights`` (waiting as long for the send) and loads only a round that is exactly the
promise, as the real engine does: otherwise the model is untouched and the update answers
the refusal (TransferFailed: nothing to join, a wire that broke or timed out; TransferMismatch:
bytes other than the promised; ManifestInvalid, TensorMismatch, DrafterMissing: a promise that
does not fit the pod). ``refit_received`` reads the last round back, refusals again. A process
that restarts forgets its group and its rounds. A pod served as a real process (SimFleet) has
no trainer in its process: its init waits out its timeout.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from refit_worker import contract
from refit_worker.contract import DRAFTER_PREFIX, TransferManifest, TransferTensor
from refit_worker.transfer_manifest import manifest_of, parse_manifest, split_drafter, tensor_digest

from testbed.simworker.errors import body_field_missing, rpc_failure
from testbed.simworker.model import SIM_PARAMS
from testbed.simworker.pod import PodState


def sim_tensors(seed: str, drafter: str | None = None) -> dict[str, str]:
    """What a trainer sends of the simulated model: tensor name -> the seed its bytes hold
    (and the drafter's, under contract.DRAFTER_PREFIX, when ``drafter`` names its seed)."""
    out = dict.fromkeys(SIM_PARAMS, seed)
    if drafter is not None:
        out |= {DRAFTER_PREFIX + n: drafter for n in SIM_PARAMS}
    return out


def sim_transfer_manifest(tensors: dict[str, str]) -> TransferManifest:
    """The promise (or the record of what arrived) of these simulated tensors."""
    out = {}
    for name, seed in tensors.items():
        param = SIM_PARAMS[name.removeprefix(DRAFTER_PREFIX)]
        shape = tuple(param.shape or ())
        digest = tensor_digest(name, param.dtype, shape, seed.encode())
        out[name] = TransferTensor(param.dtype, shape, digest)
    return manifest_of(out)


@dataclass
class Rendezvous:
    """One round's wire, opened by the trainer: ``sent`` is set once it sent ``tensors``
    (None: it died mid-send and the wire broke)."""

    world_size: int
    sent: asyncio.Event = field(default_factory=asyncio.Event)
    tensors: dict[str, str] | None = None

    def send(self, tensors: dict[str, str]) -> None:
        self.tensors = dict(tensors)
        self.sent.set()

    def die(self) -> None:
        self.tensors = None
        self.sent.set()


@dataclass
class TransferRound:
    number: int
    state: str = "started"  # started -> loaded | refused
    code: str = ""
    detail: str = ""
    promised: str = ""
    received: TransferManifest | None = None
    finished: bool = False


@dataclass
class TransferEngine:
    """A pod process's refit-gloo engine: the group it joined and its last round."""

    group: Rendezvous | None = None
    rank: int = 0
    world_size: int = 0
    timeout: float = 0.0
    rounds: int = 0
    round: TransferRound | None = None


class TransferRoutes:
    """``on_<step>(request, pod, body, fault)`` for the weight-transfer routes; the server
    keeps the open rendezvous (``rendezvous``: (host, port) -> Rendezvous)."""

    rendezvous: dict[tuple[str, int], Rendezvous]
    opened: dict[tuple[str, int], asyncio.Event]
    # An engine that loads each tensor as it arrives, as vLLM's built-in NCCL engine does,
    # so that a round refused at its end has touched the model (tests switch it on to show
    # the explorer sees a pod put back in traffic on bytes nobody probed).
    loads_as_it_receives = False

    def open_rendezvous(self, host: str, port: int, world_size: int) -> Rendezvous:
        """The trainer opens its rendezvous for a round (replacing the last round's)."""
        r = Rendezvous(world_size)
        self.rendezvous[(host, port)] = r
        self.opened.setdefault((host, port), asyncio.Event()).set()
        return r

    def engine(self, pod: PodState) -> TransferEngine:
        """The pod process's engine (a restart gives the new process a fresh one: fresh())."""
        if pod.transfer is None:
            pod.transfer = TransferEngine()
        assert isinstance(pod.transfer, TransferEngine)
        return pod.transfer

    @staticmethod
    def _refused(request: web.Request, code: str, detail: str) -> web.Response:
        return rpc_failure(request, str(contract.RefitRejected(code, detail)))

    async def on_init_weight_transfer_engine(
        self, request: web.Request, pod: PodState, body: Any, fault: Any
    ):
        if not isinstance(body, dict) or "init_info" not in body:
            return body_field_missing("init_info", None)  # vLLM's Body(...) field
        engine = self.engine(pod)
        engine.group = None  # a new trainer (or a retry) replaces the old group
        info = body["init_info"] or {}
        host, port = str(info.get("master_address")), int(info.get("master_port", 0))
        rank, world = int(info.get("rank_offset", 0)), int(info.get("world_size", 0))
        timeout = float(info.get("timeout_seconds", 60))
        where = f"rank {rank} of {world} at {host}:{port}"
        if not 0 < rank < world:
            return self._refused(request, "TransferFailed", f"{where}: not a receiver's rank")
        opened = self.opened.setdefault((host, port), asyncio.Event())
        try:
            await asyncio.wait_for(opened.wait(), timeout)
        except TimeoutError:
            return self._refused(
                request, "TransferFailed", f"joining {where} failed: no rendezvous in {timeout:g}s"
            )
        group = self.rendezvous[(host, port)]
        if group.world_size != world:  # gloo waits for ranks that never come
            return self._refused(
                request,
                "TransferFailed",
                f"joining {where} failed: the trainer opened it for {group.world_size}",
            )
        engine.group, engine.rank, engine.world_size, engine.timeout = group, rank, world, timeout
        return web.json_response({"message": "Weight transfer initialized"})

    async def on_start_weight_update(
        self, request: web.Request, pod: PodState, body: Any, fault: Any
    ):
        engine = self.engine(pod)
        if engine.round is not None and not engine.round.finished:
            return rpc_failure(
                request,
                "start_weight_update called while a weight update is already active. "
                "Call finish_weight_update first.",
            )
        engine.rounds += 1
        engine.round = TransferRound(engine.rounds)
        return web.json_response({"message": "Weight update started"})

    async def on_update_weights(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        if not isinstance(body, dict) or "update_info" not in body:
            return body_field_missing("update_info", None)
        engine = self.engine(pod)
        current = engine.round
        if current is None or current.finished:
            return rpc_failure(request, "start_weight_update must be called before update_weights.")
        problem: tuple[str, str] | None = None
        promise: TransferManifest | None = None
        if current.state != "started":
            current = engine.round = TransferRound(current.number)
            problem = ("TransferFailed", "a second update_weights in one update")
        else:
            promise, problem = self._check_promise(pod, current, body)
        group = engine.group
        sent: dict[str, str] | None = None
        if group is None:
            problem = ("TransferFailed", "not initialized: init_weight_transfer_engine")
        else:  # the wire is drained whatever the promise: the peers go on
            try:
                await asyncio.wait_for(group.sent.wait(), engine.timeout)
                sent = group.tensors
            except TimeoutError:
                pass
            if sent is None:
                engine.group = None  # a broken collective cannot be resumed: init again
                problem = problem or ("TransferFailed", "the wire broke (after 0 tensors)")
        if sent is not None:
            current.received = sim_transfer_manifest(sent)
            if self.loads_as_it_receives and promise is not None:
                self._load(pod, sent)
        if problem is None and promise is not None and sent is not None:
            differ = sorted(
                n for n, t in current.received.tensors.items()  # type: ignore[union-attr]
                if promise.tensors.get(n) != t
            )  # fmt: skip
            missing = sorted(promise.tensors.keys() - sent.keys())
            if differ or missing:
                what = [f"{n}: its bytes differ from the promise" for n in differ]
                what += [f"promised but not sent: {', '.join(missing)}"] if missing else []
                problem = ("TransferMismatch", "; ".join(what))
        if problem is not None:
            current.state, current.code, current.detail = "refused", *problem
            current.finished = True  # vLLM's worker ends the update it refused
            return self._refused(request, *problem)
        assert sent is not None
        self._load(pod, sent)
        current.state = "loaded"
        return web.json_response({"message": "Weights updated"})

    @staticmethod
    def _load(pod: PodState, sent: dict[str, str]) -> None:
        target, drafted = split_drafter(sent.items())
        pod.seed, pod.drift, pod.weights_discarded = target[0][1], 0.0, False
        if drafted:
            pod.drafter_seed = drafted[0][1]

    @staticmethod
    def _check_promise(
        pod: PodState, current: TransferRound, body: Any
    ) -> tuple[TransferManifest | None, tuple[str, str] | None]:
        info = (body or {}).get("update_info") if isinstance(body, dict) else None
        try:
            promise = parse_manifest((info or {}).get("manifest"))
        except (contract.ContractError, AttributeError) as exc:
            return None, ("ManifestInvalid", str(exc))
        current.promised = promise.digest
        target, drafted = split_drafter(promise.tensors.items())
        if {n for n, _ in target} != set(SIM_PARAMS):
            return None, ("TensorMismatch", "the promise's tensors are not the model's")
        if drafted and not pod.drafter:
            return None, ("TensorMismatch", "drafter tensors and no draft_model drafter")
        if pod.drafter and not drafted:
            return None, ("DrafterMissing", "the broadcast carries no drafter tensors")
        return promise, None

    async def on_finish_weight_update(
        self, request: web.Request, pod: PodState, body: Any, fault: Any
    ):
        current = self.engine(pod).round
        if current is None or current.finished:
            return rpc_failure(
                request, "finish_weight_update called without a matching start_weight_update."
            )
        current.finished = True
        version = (body or {}).get("weight_version") if isinstance(body, dict) else None
        if version is not None:  # vLLM sets the served version with it
            pod.weight_version = str(version)
        return web.json_response({"message": "Weight update finished"})

    async def on_refit_received(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        engine = self.engine(pod)
        args = list((body or {}).get("args") or [])
        digest, version = [*args, "", ""][:2]
        current = engine.round
        if current is None:
            return self._refused(
                request, "TransferFailed", "no broadcast received since the engine started"
            )
        if current.state == "refused":
            return self._refused(request, current.code, current.detail)
        if current.state != "loaded" or current.received is None:
            return self._refused(
                request, "TransferFailed", f"round {current.number} received nothing yet"
            )
        if digest and digest != current.received.digest:
            return self._refused(
                request,
                "TransferMismatch",
                f"round {current.number} loaded {current.received.digest}, not {digest}",
            )
        if version:
            pod.loaded_version = str(version)
        result = {
            "round": current.number, "state": current.state, "digest": current.received.digest,
            "promisedDigest": current.promised, "tensors": len(current.received.tensors),
            "finished": current.finished, "rank": engine.rank, "worldSize": engine.world_size,
            "version": pod.loaded_version,
        }  # fmt: skip
        return web.json_response({"results": [result]})
