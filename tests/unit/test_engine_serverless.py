"""Issue 28: an Engine constructed without an API server or a worker socket: the Kube
protocol (here the explorer's in-memory cluster), a worker factory (in-process simulated
workers) and the operator's clock on virtual time. One tick decides and starts the passes;
the passes take the claims, drive the workers with fencing tokens and finish."""

from __future__ import annotations

import asyncio

from refit_operator import times
from refit_operator.engine import Engine
from refit_operator.worker_client import WorkerClient

from testbed.explorer.explore import ROOT, VERSIONS
from testbed.explorer.memcluster import MemoryCluster, Store, pod_body, refit_body
from testbed.explorer.vtime import VirtualClock, VirtualLoop
from testbed.explorer.workers import ExplorerSimServer, InProcessSession, checkpoints


def test_an_engine_without_a_server_refits_a_fleet() -> None:
    clock = VirtualClock()
    loop = VirtualLoop(clock)
    ckpt = checkpoints(ROOT, VERSIONS[:1])

    async def main() -> tuple[str, list[str | None]]:
        store = Store()
        sim = ExplorerSimServer(["10.9.0.1", "10.9.0.2"], str(ROOT), None)
        session = InProcessSession(sim)
        for i, ip in enumerate(sim.pods):
            store.create("Pod", "ns", pod_body(f"p{i}", ip, {"app": "a"}))
        spec = {"fleet": {"selector": {"matchLabels": {"app": "a"}}},
                "checkpoint": {"path": ckpt["v1"], "version": "v1"}}  # fmt: skip
        store.create("WeightRefit", "ns", refit_body("wr", spec))
        engine = Engine(
            MemoryCluster(store, "op"),
            None,
            workers=lambda url, **kw: WorkerClient(url, http=session, **kw),  # type: ignore[arg-type]
        )
        await engine.sync(["ns"])
        phase = ""
        for _ in range(60):
            d = await engine.tick("ns", "wr")
            assert d is not None
            phase = d.status.phase
            if phase == "Succeeded":
                break
            await asyncio.sleep(1.0)
        fences = [call["fence"] for pod in sim.pods.values() for call in pod.calls
                  if call["step"] == "refit_load"]  # fmt: skip
        assert fences and all(isinstance(f, int) for f in fences)
        return phase, [sim.serves(ip) for ip in sim.pods]

    try:
        with times.using(clock):
            phase, serving = loop.run_until_complete(main())
    finally:
        loop.close()
    assert phase == "Succeeded"
    assert serving == ["v1", "v1"]
    assert clock.elapsed > 0  # the passes ran on virtual time
