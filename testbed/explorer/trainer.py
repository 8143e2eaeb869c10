"""A trainer sending a broadcast refit's weights, on the explorer's clock: what
``RefitClient.broadcast`` does (its ConfigMap with the promise and the probe reference, the
WeightRefit, then per round: wait for ReceiversReady, open the rendezvous, announce the round,
send), over the in-memory API server and the simulated wire (testbed.simworker.transfer).
testbed/broadcast_trainer.py is the same trainer as a real process over gloo, for the cluster
tests; this one runs thousands of schedules.

Its fault (``broadcast_rounds``): ``ontime``; ``late``, each round opened and announced
``delay`` seconds after ReceiversReady (past the transfer timeout, or the refit's, or not);
``dies``, the process dies in round ``die_round`` after its announcement, mid-send, and sends
nothing more; ``wrong``, every round's bytes differ from the promise (a trainer that changed a
tensor after it promised it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException
from refit_client.client import _round_ready
from refit_operator.core.api import SENDING_ANNOTATION

from testbed.simworker.transfer import sim_tensors

from .memcluster import Store
from .workers import ExplorerSimServer

FINAL = frozenset({"Succeeded", "Failed", "Halted", "RolledBack", "Superseded"})
WATCH_SECONDS = 0.5  # how often it reads the refit's status (the client's watch)
WIRE_SECONDS = 0.2  # from its announcement to the last tensor on the wire
FAULTS = ("ontime", "late", "dies", "wrong")


@dataclass
class SimTrainer:
    store: Store
    sim: ExplorerSimServer
    note: Callable[[str], None]
    namespace: str
    name: str
    version: str
    host: str
    port: int
    fault: str = "ontime"
    delay: float = 0.0  # late: seconds from ReceiversReady to its announcement
    die_round: int = 1  # dies: the round it dies in
    drafter: bool = False  # the fleet's pods run a draft_model drafter: send its tensors too

    def tensors(self) -> dict[str, str]:
        """What it sends: its version's weights (and drafter), or other bytes (wrong)."""
        seed = f"{self.version}~changed" if self.fault == "wrong" else self.version
        return sim_tensors(seed, self.version if self.drafter else None)

    def promise(self) -> dict[str, str]:
        return sim_tensors(self.version, self.version if self.drafter else None)

    async def run(self) -> None:
        sent = 0
        while True:
            doc = self.store.peek("WeightRefit", self.namespace, self.name)
            status: dict[str, Any] = (doc or {}).get("status") or {}
            if doc is None or status.get("phase") in FINAL:
                return
            ready = _round_ready(status)
            if ready is not None and ready[0] > sent:
                number, world = ready
                sent = number
                if self.fault == "late":
                    await asyncio.sleep(self.delay)
                wire = self.sim.open_rendezvous(self.host, self.port, world)
                try:
                    patch = {"metadata": {"annotations": {SENDING_ANNOTATION: str(number)}}}
                    self.store.patch("WeightRefit", self.namespace, self.name, patch)
                except ApiException:
                    return  # the refit is gone
                self.note(f"trainer {self.name}: round {number} announced (world {world})")
                await asyncio.sleep(WIRE_SECONDS)
                if self.fault == "dies" and number >= self.die_round:
                    wire.die()
                    self.note(f"trainer {self.name}: died mid-send in round {number}")
                    return
                wire.send(self.tensors())
            await asyncio.sleep(WATCH_SECONDS)
