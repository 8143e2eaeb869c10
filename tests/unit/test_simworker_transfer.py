"""testbed/simworker/transfer.py: the simulated refit-gloo engine, driven by the operator's
own receive (controller/sources/broadcast.receive_broadcast) over the in-process session the
explorer uses, with a trainer that sends the promise, other bytes, or dies."""

from __future__ import annotations

import asyncio

import pytest
from refit_operator.controller.sources.broadcast import receive_broadcast
from refit_operator.core.api import Broadcast
from refit_operator.core.api_spec import WeightRefitSpec
from refit_operator.edges.worker_client import WorkerClient, WorkerError

from testbed.explorer.workers import ExplorerSimServer, InProcessSession
from testbed.simworker.transfer import sim_tensors, sim_transfer_manifest

IP, HOST, PORT = "10.0.0.1", "10.9.0.1", 29501
PROMISE = sim_transfer_manifest(sim_tensors("v2"))


def broadcast(timeout: int = 5) -> Broadcast:
    spec = WeightRefitSpec.model_validate(
        {
            "fleet": {"selector": {"matchLabels": {"app": "rollout"}}},
            "broadcast": {
                "version": "v2",
                "rendezvous": {"host": HOST, "port": PORT},
                "manifest": {"configMapRef": {"name": "m"}, "digest": PROMISE.digest},
                "timeoutSeconds": timeout,
            },
            "probe": {"reference": {"source": "ConfigMap", "configMapRef": {"name": "m"}}},
        }
    )
    assert spec.broadcast is not None
    return spec.broadcast


async def receive(trainer: str) -> tuple[ExplorerSimServer, dict[str, object] | WorkerError]:
    sim = ExplorerSimServer([], "/", None)
    sim.add_pod(IP)
    client = WorkerClient(f"http://{IP}:8000", http=InProcessSession(sim))  # type: ignore[arg-type]

    async def send() -> None:
        await asyncio.sleep(0.01)
        if trainer == "silent":
            return
        wire = sim.open_rendezvous(HOST, PORT, 2)
        await asyncio.sleep(0.01)
        if trainer == "dies":
            wire.die()
        else:
            wire.send(sim_tensors("v2~changed" if trainer == "wrong" else "v2"))

    sender = asyncio.create_task(send())
    try:
        got: dict[str, object] | WorkerError = await receive_broadcast(
            client,
            broadcast(timeout=1),
            PROMISE.to_json_dict(),
            1,
            2,
            "v2",
            2.0,
        )
    except WorkerError as e:
        got = e
    await sender
    return sim, got


async def test_the_promised_bytes_are_loaded_and_read_back() -> None:
    sim, got = await receive("ontime")
    assert isinstance(got, dict), got
    assert (got["digest"], got["rank"], got["worldSize"]) == (PROMISE.digest, 1, 2)
    pod = sim.pods[IP]
    assert (pod.seed, pod.weight_version, pod.loaded_version) == ("v2", "v2", "v2")


@pytest.mark.parametrize(
    ("trainer", "code"),
    [("wrong", "TransferMismatch"), ("dies", "TransferFailed"), ("silent", "TransferFailed")],
)
async def test_other_bytes_a_broken_wire_or_no_trainer_leave_the_model_untouched(
    trainer: str, code: str
) -> None:
    sim, got = await receive(trainer)
    assert isinstance(got, WorkerError) and got.code == code, got
    pod = sim.pods[IP]
    assert (pod.seed, pod.weight_version) == (None, "default")  # the model as it started
