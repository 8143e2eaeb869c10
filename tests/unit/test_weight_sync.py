"""refit_client.weight_sync without a cluster or vLLM: how vLLM's four client calls (and
refit-gloo's promise and rounds) map onto the broadcast handshake, against a RefitClient
whose API edges are scripted (tests.fixtures.scripted_refits), and which engines it refuses
before anything is created."""

from __future__ import annotations

import pytest
from refit_client.client import RefitFailed
from refit_client.refit_error import RefitError
from refit_client.weight_sync import RefitWeightSyncClient
from refit_worker.contract import TransferManifest, TransferTensor

from tests.fixtures.scripted_refits import ScriptedRefits, ready

MANIFEST = TransferManifest({"w": TransferTensor("F32", (2,), "a" * 64)}, "b" * 64)
OTHER = TransferManifest({"w": TransferTensor("F32", (2,), "c" * 64)}, "d" * 64)
GLOO_INIT = {"master_address": "10.0.0.5", "master_port": 29500, "timeout_seconds": 30.0}
# What vLLM's NCCL trainer engine hands the client at trainer_init (nccl_common's
# worker_init_payload of NCCLWeightTransferInitInfo): one world, fixed for the trainer's life.
NCCL_INIT = {"master_address": "10.0.0.5", "master_port": 29500, "rank_offset": 1,
             "world_size": 3, "packed": True}  # fmt: skip
SUCCEEDED = {"phase": "Succeeded", "broadcast": {"round": 1, "state": "Done"}}
HALTED = {
    "phase": "Halted",
    "message": "halted: 2 pods failed (failureLimit 0)",
    "conditions": [{"type": "Ready", "status": "False", "reason": "FailureLimitExceeded",
                    "message": "halted"}],
    "pods": [{"name": "vllm-0", "phase": "Failed", "reason": "TransferMismatch",
              "message": "tensor w differs from its promise"}],
}  # fmt: skip


def engine_send(client: RefitWeightSyncClient, manifest: TransferManifest = MANIFEST) -> list[int]:
    """What refit-gloo's trainer engine does in send_weights with a fleet client (its
    _send_to_fleet), minus the sockets: the worlds it opened a rendezvous for."""
    client.promise(manifest)
    client.start_weight_update()
    worlds = []
    for world in client.rounds():
        worlds.append(world)
        client.update_weights({"manifest": manifest.to_json_dict()})
    client.finish_weight_update()
    return worlds


def test_one_send_is_one_refit_start_waits_for_the_round_finish_for_the_verdict():
    sending = {"phase": "Progressing", "broadcast": {"round": 1, "state": "Sending"}}
    refits = ScriptedRefits([{"phase": "Pending"}, ready(1, 3), sending, SUCCEEDED])
    client = RefitWeightSyncClient(refits, fleet_selector={"app": "rollout"}, timeout=60,
                                   strategy="AllAtOnce", port=8000)  # fmt: skip
    client.init_weight_transfer_engine(GLOO_INIT)
    assert refits.log == []  # init only says where the rendezvous will be
    client.prepare("step-1", {"formatVersion": 1})
    client.promise(MANIFEST)
    client.start_weight_update()
    # start: the refit, then the wait until its first round's receivers are ready.
    assert refits.log == [("create", "refit-step-1"), ("status", "Pending", None),
                          ("status", "Progressing", 1)]  # fmt: skip
    (made,) = refits.created
    assert made["manifest"] is MANIFEST and made["version"] == "step-1"
    assert made["rendezvous"] == ("10.0.0.5", 29500)
    assert made["transfer_timeout_seconds"] == 30
    assert made["fleet_selector"] == {"app": "rollout"} and made["namespace"] == "rl"
    assert (made["strategy"], made["port"]) == ("AllAtOnce", 8000)
    worlds = []
    for world in client.rounds():
        worlds.append(world)
        client.update_weights({"manifest": MANIFEST.to_json_dict()})  # the announcement
        assert refits.log[-1] == ("announce", "refit-step-1", 1)
    assert worlds == [3]
    client.finish_weight_update()
    assert refits.log[-1] == ("status", "Succeeded", 1)
    assert client.last_status == SUCCEEDED and client.version == "step-1"


def test_rolling_rounds_each_get_a_world_and_an_announcement():
    refits = ScriptedRefits([ready(1, 2), ready(1, 2), ready(2, 2), SUCCEEDED])
    client = RefitWeightSyncClient(refits, fleet_selector="app=rollout", timeout=60)
    client.init_weight_transfer_engine(GLOO_INIT)
    client.prepare("step-2", {"formatVersion": 1}, name="custom")
    assert engine_send(client) == [2, 2]  # round 1 reported twice: one send
    assert [e for e in refits.log if e[0] == "announce"] == [
        ("announce", "custom", 1), ("announce", "custom", 2)
    ]  # fmt: skip


def test_a_failed_refit_raises_the_operators_reason_and_the_next_send_starts_clean():
    refits = ScriptedRefits([ready(1, 3), HALTED], [ready(1, 3), SUCCEEDED])
    client = RefitWeightSyncClient(refits, fleet_selector="app=rollout", timeout=60)
    client.init_weight_transfer_engine(GLOO_INIT)
    client.prepare("step-3", {"formatVersion": 1})
    with pytest.raises(RefitFailed) as failed:
        engine_send(client)
    assert (failed.value.phase, failed.value.reason) == ("Halted", "FailureLimitExceeded")
    assert [(f.pod, f.reason) for f in failed.value.pod_failures] == [
        ("vllm-0", "TransferMismatch")
    ]
    assert client.last_status is None
    # Each send needs its own version: the failed one's is not reused.
    with pytest.raises(RefitError, match="prepare"):
        engine_send(client)
    client.prepare("step-4", {"formatVersion": 1})
    assert engine_send(client) == [3]
    assert [c["version"] for c in refits.created] == ["step-3", "step-4"]


def test_a_refit_that_ends_before_any_round_sends_nothing_and_raises():
    refits = ScriptedRefits([{"phase": "Pending"}, HALTED])
    client = RefitWeightSyncClient(refits, fleet_selector="app=rollout", timeout=60)
    client.init_weight_transfer_engine(GLOO_INIT)
    client.prepare("step-5", {"formatVersion": 1})
    with pytest.raises(RefitFailed):
        engine_send(client)
    assert not [e for e in refits.log if e[0] == "announce"]


def test_an_engine_with_a_fixed_world_is_refused_at_init():
    """NCCL's trainer engine opens one group of trainer + workers at trainer_init; a fleet's
    worlds are the operator's rounds. Refused before anything exists, and with no init the
    client refuses to start."""
    refits = ScriptedRefits()
    client = RefitWeightSyncClient(refits, fleet_selector="app=rollout", timeout=60)
    with pytest.raises(RefitError, match="fixes one world") as refused:
        client.init_weight_transfer_engine(NCCL_INIT)
    assert "refit-gloo" in str(refused.value)
    client.prepare("step-6", {"formatVersion": 1})
    client.promise(MANIFEST)
    with pytest.raises(RefitError, match="before init_weight_transfer_engine"):
        client.start_weight_update()
    assert refits.log == [] and refits.created == []


def test_an_engine_without_a_promise_is_refused_at_start():
    """vLLM's other engines call start without refit-gloo's promise: no refit pins a digest."""
    refits = ScriptedRefits()
    client = RefitWeightSyncClient(refits, fleet_selector="app=rollout", timeout=60)
    client.init_weight_transfer_engine({"master_address": "h", "master_port": 1})
    client.prepare("step-7", {"formatVersion": 1})
    with pytest.raises(RefitError, match="no promise"):
        client.start_weight_update()
    assert refits.created == []


@pytest.mark.parametrize(
    "init", [{}, {"master_address": "h"}, {"master_address": "h", "master_port": "x"}]
)
def test_init_without_a_rendezvous_is_refused(init):
    client = RefitWeightSyncClient(ScriptedRefits(), fleet_selector="app=rollout", timeout=60)
    with pytest.raises(RefitError, match="without a rendezvous"):
        client.init_weight_transfer_engine(init)


def test_an_update_of_another_promise_is_not_announced():
    refits = ScriptedRefits([ready(1, 3), SUCCEEDED])
    client = RefitWeightSyncClient(refits, fleet_selector="app=rollout", timeout=60)
    client.init_weight_transfer_engine(GLOO_INIT)
    client.prepare("step-8", {"formatVersion": 1})
    client.promise(MANIFEST)
    with pytest.raises(RefitError, match="outside a round"):
        client.update_weights({"manifest": MANIFEST.to_json_dict()})
    client.start_weight_update()
    next(iter(client.rounds()))
    for info in ({"manifest": OTHER.to_json_dict()}, {}, [MANIFEST.to_json_dict()]):
        with pytest.raises(RefitError, match="another promise"):
            client.update_weights(info)
    assert not [e for e in refits.log if e[0] == "announce"]


def test_finish_at_another_version_is_refused():
    refits = ScriptedRefits([ready(1, 3), SUCCEEDED])
    client = RefitWeightSyncClient(refits, fleet_selector="app=rollout", timeout=60)
    client.init_weight_transfer_engine(GLOO_INIT)
    client.prepare("step-9", {"formatVersion": 1})
    client.promise(MANIFEST)
    client.start_weight_update()
    with pytest.raises(RefitError, match="'step-10'"):
        client.finish_weight_update("step-10")
    client.finish_weight_update("step-9")  # the refit still followed to its verdict
    assert client.last_status == SUCCEEDED


def test_a_timeout_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="timeout"):
        RefitWeightSyncClient(ScriptedRefits(), fleet_selector="app=rollout", timeout=0)
