"""Issue 28: an Engine constructed without an API server or a worker socket: the Kube
protocol (here the explorer's in-memory cluster), a worker factory (in-process simulated
workers) and the operator's clock on virtual time. One tick decides and starts the passes;
the passes take the claims, drive the workers with fencing tokens and finish. The seam shows
what a tick does: it writes its decision once, forgets a refit deleted mid-pass, and stops
before its next write once the lease check raises."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from refit_client.refit_document import build_refit
from refit_operator.controller.reconcile_loop import Engine
from refit_operator.core import times
from refit_operator.core.api_status import BroadcastRound, PodResult, WeightRefitStatus
from refit_operator.core.claim import CLAIM_ANNOTATION, Claim
from refit_operator.core.decision import Decision, Event
from refit_operator.core.status import PROGRESS_WRITE_SECONDS, write_now
from refit_operator.edges.leader import LeadershipLost, Lease
from refit_operator.edges.worker_client import WorkerClient

from testbed.explorer.explore import ROOT, VERSIONS
from testbed.explorer.memcluster import MemoryCluster, MemoryLeases, Store, finalized, pod_body
from testbed.explorer.vtime import VirtualClock, VirtualLoop
from testbed.explorer.workers import ExplorerSimServer, InProcessSession, checkpoints

T = TypeVar("T")
NS = "ns"


@dataclass
class Bed:
    """An Engine over the in-memory cluster, with a fleet of simulated workers and one
    WeightRefit ``wr`` of them to v1."""

    store: Store
    sim: ExplorerSimServer
    cluster: MemoryCluster
    engine: Engine

    def status(self) -> dict[str, Any]:
        """The refit's status as stored, as the engine compares statuses."""
        doc = self.store.objects[("WeightRefit", NS, "wr")]
        return WeightRefitStatus.model_validate(doc.get("status") or {}).dump()

    def worker_calls(self) -> int:
        return sum(len(pod.calls) for pod in self.sim.pods.values())


async def _bed(
    pods: int = 2, lease: Lease | None = None, store: Store | None = None, **refit: Any
) -> Bed:
    store = store or Store()
    sim = ExplorerSimServer([f"10.9.0.{i + 1}" for i in range(pods)], str(ROOT), None)
    session = InProcessSession(sim)
    for i, ip in enumerate(sim.pods):
        store.create("Pod", NS, pod_body(f"p{i}", ip, {"app": "a"}))
    ckpt = checkpoints(ROOT, VERSIONS[:1])
    doc = build_refit("wr", ckpt["v1"], "v1", fleet_selector={"app": "a"}, **refit)
    store.create("WeightRefit", NS, finalized(doc))
    cluster = MemoryCluster(store, "op")
    engine = Engine(
        cluster,
        None,
        lease,
        workers=lambda url, **kw: WorkerClient(url, http=session, **kw),  # type: ignore[arg-type]
    )
    await engine.sync([NS])
    return Bed(store, sim, cluster, engine)


def _on_virtual_time(main: Callable[[VirtualClock], Coroutine[Any, Any, T]]) -> T:
    """Run ``main`` on a virtual loop, with the operator's clock on the loop's time."""
    clock = VirtualClock()
    loop = VirtualLoop(clock)
    try:
        with times.using(clock):
            return loop.run_until_complete(main(clock))
    finally:
        loop.close()


def test_an_engine_without_a_server_refits_a_fleet() -> None:
    async def main(clock: VirtualClock) -> tuple[str, list[str | None], float]:
        bed = await _bed()
        phase = ""
        for _ in range(60):
            d = await bed.engine.tick(NS, "wr")
            assert d is not None
            phase = d.status.phase
            if phase == "Succeeded":
                break
            await asyncio.sleep(1.0)
        fences = [call["fence"] for pod in bed.sim.pods.values() for call in pod.calls
                  if call["step"] == "refit_load"]  # fmt: skip
        assert fences and all(isinstance(f, int) for f in fences)
        return phase, [bed.sim.serves(ip) for ip in bed.sim.pods], clock.elapsed

    phase, serving, elapsed = _on_virtual_time(main)
    assert phase == "Succeeded"
    assert serving == ["v1", "v1"]
    assert elapsed > 0  # the passes ran on virtual time


def test_a_tick_writes_its_decision_once() -> None:
    """However many pods step, a tick writes the status once, and only when its decision
    differs from the status it read."""

    async def main(clock: VirtualClock) -> list[tuple[bool, int]]:
        bed = await _bed(pods=4)
        writes: list[str] = []
        patch = bed.cluster.patch_status

        async def counted(namespace: str, name: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
            writes.append(name)
            return await patch(namespace, name, *args, **kwargs)

        bed.cluster.patch_status = counted  # type: ignore[method-assign]
        ticks: list[tuple[bool, int]] = []  # (decision changed the status, writes)
        finished = 0
        while finished < 2 and len(ticks) < 60:  # on to a tick after the one that finished
            before, written = bed.status(), len(writes)
            d = await bed.engine.tick(NS, "wr")
            assert d is not None
            ticks.append((d.status.dump() != before, len(writes) - written))
            finished += d.status.phase == "Succeeded"
            await asyncio.sleep(1.0)
        return ticks

    ticks = _on_virtual_time(main)
    assert all(writes == int(changed) for changed, writes in ticks), ticks
    assert any(changed for changed, _ in ticks) and any(not changed for changed, _ in ticks)


def test_progress_waits_for_its_period_and_what_someone_waits_on_does_not() -> None:
    """Ticks much closer together than PROGRESS_WRITE_SECONDS (hand-offs come that fast): a
    change of progress alone is held back until the period since the last write is over; a new
    phase, or a condition turning True, is written by the tick that decided it."""

    async def main(clock: VirtualClock) -> list[tuple[float, bool, bool, str, int]]:
        # One pod at a time, each call 50 ms: passes of about half a second, one after another.
        bed = await _bed(pods=4, strategy="Rolling", max_unavailable=1)
        bed.sim.latency = lambda step: 0.05
        writes: list[float] = []
        events: list[tuple[str, str]] = []
        patch = bed.cluster.patch_status

        async def counted(namespace: str, name: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
            writes.append(clock.monotonic())
            return await patch(namespace, name, *args, **kwargs)

        bed.cluster.patch_status = counted  # type: ignore[method-assign]
        emit = bed.cluster.event

        async def event(namespace: str, involved: dict[str, Any], reason: str, message: str,
                        etype: str) -> None:  # fmt: skip
            events.append((reason, message))
            await emit(namespace, involved, reason, message, etype)

        bed.cluster.event = event  # type: ignore[method-assign]
        # (when, changed, write_now, phase, writes) per tick
        ticks: list[tuple[float, bool, bool, str, int]] = []
        while len(ticks) < 400:
            before, written = bed.status(), len(writes)
            d = await bed.engine.tick(NS, "wr")
            assert d is not None
            now = write_now(d.status, WeightRefitStatus.model_validate(before))
            changed = d.status.dump() != before
            ticks.append((clock.monotonic(), changed, now, d.status.phase, len(writes) - written))
            if d.status.phase == "Succeeded":
                break
            await asyncio.sleep(0.1)
        # An Event says a transition happened once: a tick that emits one writes the status
        # that records it, or the next tick, deciding from the same status, repeats it.
        assert events and len(events) == len(set(events)), events
        return ticks

    ticks = _on_virtual_time(main)
    assert ticks[-1][3] == "Succeeded" and ticks[-1][4] == 1  # written by the tick that decided
    assert all(n == 1 for _, changed, now, _, n in ticks if changed and now)
    held = [t for t in ticks if t[1] and not t[2] and t[4] == 0]
    assert held, f"no progress was held back: {ticks}"
    last = float("-inf")
    for when, _changed, now, _, n in ticks:
        if n and not now:  # progress alone: only once the period since the last write is over
            assert when - last >= PROGRESS_WRITE_SECONDS - 0.1, (when, last)
        if n:
            last = when


def test_a_tick_that_emits_events_writes_at_once() -> None:
    """A new message (an Event with it) within the progress period, phase unchanged: the
    status that records it is written by that tick, so the next does not emit it again."""

    async def main(clock: VirtualClock) -> tuple[list[tuple[str, str]], list[str]]:
        bed = await _bed()
        bed.sim.latency = lambda step: 0.05  # passes of about half a second: Progressing
        events: list[tuple[str, str]] = []
        emit, decide = bed.cluster.event, bed.engine._decide
        turn = [0]

        async def event(namespace: str, involved: dict[str, Any], reason: str, message: str,
                        etype: str) -> None:  # fmt: skip
            events.append((reason, message))
            await emit(namespace, involved, reason, message, etype)

        async def decided(t: Any, obs: Any) -> Decision:
            d = await decide(t, obs)
            if d.status.phase == "Progressing":  # as decision.transition says a new message
                turn[0] += 1
                message = f"message {turn[0] // 2}"  # the same on two ticks in a row
                if d.status.message != message:
                    d.events.append(Event("Progressing", message))
                d.status.message = message
            return d

        bed.cluster.event = event  # type: ignore[method-assign]
        bed.engine._decide = decided  # type: ignore[method-assign]
        shown = []
        for _ in range(6):
            await bed.engine.tick(NS, "wr")
            shown.append(str(bed.status().get("message", "")))
            await asyncio.sleep(0.1)
        return events, shown

    events, shown = _on_virtual_time(main)
    said = [m for r, m in events if r == "Progressing" and m.startswith("message")]
    assert said and len(said) == len(set(said)), events
    assert all(m in shown for m in said), (said, shown)  # each written with its Event


def test_write_now_is_what_someone_waits_on() -> None:
    def st(phase: str = "Progressing", **conds: str) -> WeightRefitStatus:
        return WeightRefitStatus.model_validate({
            "phase": phase, "observedGeneration": 1,
            "conditions": [{"type": k, "status": v, "reason": "R", "message": ""}
                           for k, v in conds.items()],
        })  # fmt: skip

    base = st(Ready="False", ReceiversReady="False", Degraded="False")
    assert write_now(st("Succeeded", Ready="True"), base)  # a new phase
    assert write_now(st(Ready="False", ReceiversReady="True", Degraded="False"), base)
    assert write_now(st(Ready="False", ReceiversReady="False", Degraded="True"), base)
    # A round received (ReceiversReady back to False) and the pods' progress are progress.
    ready = st(Ready="False", ReceiversReady="True", Degraded="False")
    assert not write_now(base, ready)
    moved = base.model_copy(update={"updated_pods": 3, "message": "3/4 pods at v1"})
    assert not write_now(moved, base)
    later = base.model_copy(update={"observed_generation": 2})
    assert write_now(later, base)  # a new generation: observedGeneration is waited on
    # Rolling: round 2 turns Ready while the status still shows round 1 Ready (its Done held
    # back): ReceiversReady stays True, the round is new, the trainer waits on it.
    r1 = ready.model_copy(update={"broadcast": BroadcastRound(round=1, state="Ready")})
    r2 = ready.model_copy(update={"broadcast": BroadcastRound(round=2, state="Ready")})
    assert write_now(r2, r1)
    done1 = ready.model_copy(update={"broadcast": BroadcastRound(round=1, state="Done")})
    assert not write_now(done1, r1) and not write_now(r1, r1)
    # A pod that left: only the status remembers it.
    dropped = base.model_copy(update={"pods": [PodResult(name="p1", phase="Dropped", step="")]})
    assert write_now(dropped, base) and not write_now(dropped, dropped)
    done = st("Succeeded", Ready="True")
    assert write_now(done.model_copy(update={"updated_pods": 4}), done)  # finished: ticks rare


def test_a_refit_deleted_mid_pass_is_forgotten() -> None:
    """The tick that finds its refit gone drops what was kept for it and cancels its passes."""

    async def main(clock: VirtualClock) -> None:
        bed = await _bed()
        d = await bed.engine.tick(NS, "wr")
        assert d is not None and d.start
        uid = bed.store.objects[("WeightRefit", NS, "wr")]["metadata"]["uid"]
        tasks = bed.engine.refits[uid].passes.running()
        assert tasks and not any(t.done() for t in tasks)
        bed.store.remove("WeightRefit", NS, "wr")
        assert await bed.engine.tick(NS, "wr") is None
        assert uid not in bed.engine.refits
        assert uid not in bed.engine.index.known
        await asyncio.wait(tasks, timeout=10.0)
        assert all(t.cancelled() for t in tasks)

    _on_virtual_time(main)


def test_a_lost_lease_stops_the_engine_before_its_next_write() -> None:
    """Once the lease check raises, the tick stops at its first write, and the passes at
    their next request: nothing more reaches the cluster or the pods."""

    async def main(clock: VirtualClock) -> None:
        store = Store()
        lease = Lease(None, "refit-system", "refit", "op", 15, api=MemoryLeases(store))
        await lease.acquire()
        bed = await _bed(lease=lease, store=store)
        d = await bed.engine.tick(NS, "wr")
        assert d is not None and d.start
        lease.lost.set()
        await asyncio.sleep(1.0)  # what was sent before lands
        revision, calls = store.revision, bed.worker_calls()
        with pytest.raises(LeadershipLost):
            await bed.engine.tick(NS, "wr")
        await asyncio.sleep(30.0)
        assert (store.revision, bed.worker_calls()) == (revision, calls)

    _on_virtual_time(main)


def test_a_claim_of_a_refit_not_yet_seen_is_left_to_its_live_holder() -> None:
    """Another operator process claimed pod p0 for a refit created after this process's watch
    last showed the refits (its ADDED event not in yet). That pass is alive on its holder's
    Lease, so this process's tick leaves p0 to it (found by the explorer: a base pass took over
    a live adapter pass, and the adapter's staged name stayed loaded). Once that refit is gone,
    the claim is a crashed pass's, and the pod is this refit's to drive."""

    async def main(clock: VirtualClock) -> tuple[list[str], list[str], str]:
        store = Store()
        lease = Lease(None, "refit-system", "refit", "op", 15, api=MemoryLeases(store))
        theirs = Lease(None, "refit-system", "theirs", "op-b", 15, api=MemoryLeases(store))
        await lease.acquire()
        await theirs.acquire()
        bed = await _bed(lease=lease, store=store)
        ckpt = checkpoints(ROOT, VERSIONS[:1])
        late = store.create("WeightRefit", NS, finalized(build_refit(
            "late", ckpt["v1"], "v1", fleet_selector={"app": "elsewhere"})))  # fmt: skip
        claim = Claim("late", late["metadata"]["uid"], 7, "op-b", "refit-system/theirs", 15)
        store.patch_pod_status(
            NS, "p0", {"metadata": {"annotations": {CLAIM_ANNOTATION: claim.to_annotation()}}}
        )
        p0 = next(ip for ip in bed.sim.pods if ip.endswith(".1"))
        await bed.engine.tick(NS, "wr")
        await asyncio.sleep(5.0)
        # What would drive the pod (the preflight's reads carry no fence).
        while_theirs = [c["step"] for c in bed.sim.pods[p0].calls if c["fence"] is not None]
        holder = Claim.from_annotation(
            store.objects[("Pod", NS, "p0")]["metadata"]["annotations"].get(CLAIM_ANNOTATION)
        )
        store.remove("WeightRefit", NS, "late")
        for _ in range(10):
            await bed.engine.tick(NS, "wr")
            await asyncio.sleep(1.0)
        return (
            while_theirs,
            [c["step"] for c in bed.sim.pods[p0].calls],
            holder.holder if holder else "",
        )

    while_theirs, after, holder = _on_virtual_time(main)
    assert while_theirs == [] and holder == "op-b"
    assert "refit_load" in after  # the refit gone, its claim no longer holds the pod


def test_a_hand_off_that_finds_its_refit_gone_forgets_it() -> None:
    """The refit was deleted and its DELETED event never came: a hand-off (a pass that ended)
    decides from the document last seen, and its status write answers 404. The engine then
    forgets the refit at once (found by the explorer: a ghost kept until the next resync)."""

    async def main(clock: VirtualClock) -> tuple[bool, bool]:
        bed = await _bed()
        d = await bed.engine.tick(NS, "wr")
        assert d is not None and d.start
        uid = bed.store.objects[("WeightRefit", NS, "wr")]["metadata"]["uid"]
        await asyncio.sleep(30.0)  # the passes end
        bed.store.remove("WeightRefit", NS, "wr")
        await bed.engine.tick(NS, "wr", fresh=False)
        return uid in bed.engine.index.known, uid in bed.engine.refits

    assert _on_virtual_time(main) == (False, False)
