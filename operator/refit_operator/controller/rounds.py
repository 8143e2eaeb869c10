"""The rounds of a broadcast refit: which pods receive one send of the trainer, their ranks,
and the handshake with the trainer (docs/broadcast.md, "A broadcast refit").

A round is the pods whose passes the engine started together (one tick's batch). Each pass
``join``s its round when it reaches the receive step, out of traffic and awake. Once every
member has joined or left (a pass that failed before), the round is Ready: each pod gets
as many consecutive ranks as it runs receiving workers (what it reported when it joined,
vLLM's /get_world_size: TP x PP x DP), in name order from rank 1, and the world size is one
more than their sum (the trainer is rank 0), and the status
shows it with the condition ReceiversReady. The trainer then opens its rendezvous and
announces the round on the WeightRefit (annotation ``SENDING_ANNOTATION``); only then do the
members call the pods' ``/init_weight_transfer_engine``, so no pod ever joins the store of
another round. Rounds are Ready one at a time, in order: a round waits until every pod of the
one before it is past its receive.

In memory only: an operator that restarts numbers its next round after the one the status
shows, and passes resumed at the receive step join a new round (the trainer sends again).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..core.api import SENDING_ANNOTATION, BroadcastRound, RoundState
from ..core.reasons import Problem, Reason


class TrainerTimeout(Exception):
    """The trainer did not announce the round in time."""


@dataclass
class _Round:
    number: int
    members: set[str]
    joined: set[str] = field(default_factory=set)
    past: set[str] = field(default_factory=set)  # members past their receive (or gone)
    workers: dict[str, int] = field(default_factory=dict)  # receiving workers per joined pod
    ranks: dict[str, int] = field(default_factory=dict)  # each pod's first rank; set once Ready
    sending: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def ready(self) -> bool:
        return bool(self.ranks)

    @property
    def done(self) -> bool:
        return self.past >= self.members

    @property
    def world_size(self) -> int:
        return sum(self.workers.get(p, 1) for p in self.ranks) + 1 if self.ranks else 0


class Rounds:
    """The rounds of one refit. ``on_change`` is called when the status should be written
    again (a round became Ready or Done)."""

    def __init__(self, last: int, on_change: Callable[[], None]) -> None:
        self._last = last  # the number of the newest round opened (or shown by the status)
        self._rounds: list[_Round] = []
        self._of: dict[str, _Round] = {}
        self._on_change = on_change

    def open(self, pods: Iterable[str]) -> None:
        """A new round for these pods (those already in an unfinished round stay there)."""
        members = {p for p in pods if p not in self._of}
        if not members:
            return
        self._last += 1
        r = _Round(self._last, members)
        self._rounds.append(r)
        for p in members:
            self._of[p] = r
        self._settle()

    async def join(self, pod: str, seconds: float, workers: int = 1) -> tuple[int, int]:
        """Wait until the pod's round is Ready and the trainer announced it: (the rank of the
        pod's first worker, world size). ``workers``: how many ranks the pod takes."""
        if workers < 1:
            raise ValueError(f"pod {pod}: {workers} receiving workers")
        r = self._of.get(pod)
        if r is None:  # a pass the engine did not put in a round (cannot happen by design)
            self.open([pod])
            r = self._of[pod]
        r.joined.add(pod)
        r.workers[pod] = workers
        self._settle()
        try:
            await asyncio.wait_for(r.sending.wait(), seconds)
        except TimeoutError:
            what = "announced" if r.ready else "became ready"
            raise TrainerTimeout(
                f"round {r.number} never {what} within {seconds:g}s "
                f"({len(r.joined)}/{len(r.members)} pods joined; the trainer sends once "
                f"ReceiversReady is True and it annotated {SENDING_ANNOTATION})"
            ) from None
        return r.ranks[pod], r.world_size

    def leave(self, pod: str) -> None:
        """The pod is past its receive (done, refused, or its pass ended before): its round
        no longer waits for it. Idempotent."""
        r = self._of.pop(pod, None)
        if r is None:
            return
        r.past.add(pod)
        if not r.ready:
            r.members.discard(pod)
            r.joined.discard(pod)
            r.workers.pop(pod, None)
        self._settle()

    def trainer_sending(self, number: int) -> None:
        """The trainer announced round ``number`` (read from the WeightRefit)."""
        for r in self._rounds:
            if r.number == number and r.ready:
                r.sending.set()

    def view(self) -> BroadcastRound | None:
        """What the status shows: the first unfinished round, else the last one."""
        if not self._rounds:
            return None
        r = next((r for r in self._rounds if not r.done), self._rounds[-1])
        state: RoundState
        if r.done:
            state = "Done"
        elif r.sending.is_set():
            state = "Sending"
        elif r.ready:
            state = "Ready"
        else:
            state = "Joining"
        return BroadcastRound(
            round=r.number, world_size=r.world_size, receivers=len(r.members), state=state
        )

    def _settle(self) -> None:
        """Make the first unfinished round Ready when all its members have joined; drop
        finished rounds but the last (the status keeps showing it)."""
        changed = False
        while len(self._rounds) > 1 and self._rounds[0].done:
            self._rounds.pop(0)
            changed = True
        for r in self._rounds:
            if r.done:
                continue
            if not r.ready and r.members and r.joined >= r.members:
                rank = 1
                for p in sorted(r.members):
                    r.ranks[p] = rank
                    rank += r.workers.get(p, 1)
                changed = True
            break  # one round at a time
        if changed or (self._rounds and self._rounds[-1].done):
            self._on_change()


def rank_problem(received: dict[str, object], rank: int, world: int) -> Problem | None:
    """What refit_received says against the round: the pod's first worker must have joined
    at the rank and world size the round gave it (older workers do not say: accepted)."""
    got = (received.get("rank"), received.get("worldSize"))
    if got in ((None, None), (rank, world)):
        return None
    return Problem(
        Reason.BroadcastWorldSizeMismatch,
        f"the pod's first worker joined as rank {got[0]} of {got[1]}, the round gave it rank "
        f"{rank} of {world}",
    )
