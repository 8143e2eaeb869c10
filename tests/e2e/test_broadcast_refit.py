"""Broadcast refits end to end on real parts: the `refit-operator` process on the real API
server drives two real vLLM CPU servers (the refit-gloo engine, the admin guard, the worker
extension), and a real trainer process (`testbed.broadcast_trainer`, through
`refit_client.client`) sends the tensors over gloo once per round; one test drives vLLM's
own trainer engine in this process instead, through Refit's VLLMWeightSyncClient
(examples/vllm_trainer_engine.py).

Every pass reads back its pod's runtime weights after the load or receive (vLLM's weight
checker and the buffers' digests, through the guard with the pass's fence): pods of one
layout at one version agree, and a pod whose parameter or non-parameter buffer was skewed
after its load (tests/worker/hazard_extension.py) fails with WeightChecksumMismatch before
its probe, though the probe alone passes it.

Each test starts from a checkpoint refit to A (the pods serve A, probed; A is the rollback
target), then broadcasts. Faults are the trainer's own (a process that dies mid-send, sends
too late, expects a rank that never joins, or changes a tensor after promising it) and a
consistent but wrong model. Every one ends with no pod serving anything unprobed (the
harness's invariant watcher) and the fleet on a probed version with a reason.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from testbed.fleet import ADMIN_SECRET, ENDED, Fleet
from testbed.operator_process import Operators
from testbed.tiny_model import TinyModel
from testbed.vllm_server import VllmServer, free_port, start_vllm_pods
from tests.fixtures.trainer import REPO, train, trainer_command

pytestmark = [pytest.mark.cluster, pytest.mark.vllm, pytest.mark.timeout(900)]

PODS = ("vllm-0", "vllm-1")
HOSTS = ("127.0.0.2", "127.0.0.3")
TRANSFER_TIMEOUT = 15  # spec.broadcast.timeoutSeconds of the fault cases
CORRUPTED = "model.layers.0.mlp.down_proj.weight"  # the tensor a fault changes
# The refit RPCs plus the test-only hooks that skew a tensor after every load.
HAZARDS = "tests.worker.hazard_extension.HazardExtension"


@pytest.fixture(scope="module")
def servers(tiny_model: TinyModel) -> Iterator[list[VllmServer]]:
    """Two pods' servers on one port at two loopback addresses, started from A's files with
    the refit-gloo engine, one admin token."""
    from refit_worker.contract import TRANSFER_BACKEND

    config = json.dumps({"backend": TRANSFER_BACKEND})
    with start_vllm_pods(
        tiny_model, HOSTS, load_format="safetensors", model_dir=tiny_model.checkpoints["A"],
        admin_token="broadcast-admin-token",
        extra_args=["--weight-transfer-config", config, "--worker-extension-cls", HAZARDS],
    ) as servers:  # fmt: skip
        yield servers


# The two servers (the pods) outlive each test's namespace, and so does the highest fencing
# token each has admitted. Each test's operator leads on a Lease in its own namespace, which
# starts from the epoch the previous tests reached, as one installation's Lease would: an
# operator restarted inside a test (a new epoch) must not fence off the tests after it.
LEASE = "refit-operator"
_epoch = {"high": 0}


@pytest.fixture
def fleet(
    harness: tuple[Fleet, Operators], servers: list[VllmServer], tiny_model: TinyModel
) -> Iterator[tuple[Fleet, Operators]]:
    """The two pods in the test's namespace, serving A after a checkpoint refit."""
    fl, op = harness
    leases = k8s.CoordinationV1Api(fl.api)
    lease = {"metadata": {"name": LEASE}, "spec": {"leaseTransitions": _epoch["high"]}}
    leases.create_namespaced_lease(fl.ns, lease)  # type: ignore[arg-type]  # serialized as is
    fl.add_server_pods(PODS, servers)
    op.start()
    st = fl.refit_server_pods(op, "to-a", "A", tiny_model.checkpoints["A"], servers[0].port,
                              timeout=180)  # fmt: skip
    assert st["phase"] == "Succeeded", (st, op.logs())
    yield fl, op
    spec = leases.read_namespaced_lease(LEASE, fl.ns).spec
    assert spec is not None
    reached = spec.lease_transitions or 0
    _epoch["high"] = max(_epoch["high"], reached)


def pod_record(fl: Fleet, name: str) -> dict[str, Any]:
    record = fl.progress(fl.pod(name))
    assert record is not None
    return record


def test_broadcast_refit_all_at_once_then_rolling(fleet, servers, tiny_model):
    fl, op = fleet
    out = train(fl, tiny_model, servers, "bcast-b", "B-bcast", tensors="B", reference="B")
    assert out["phase"] == "Succeeded", (out, op.logs())
    # AllAtOnce: one send to both pods (world: the trainer and two ranks).
    assert [r["round"] for r in out["rounds"]] == [1]
    st = out["status"]
    assert st["broadcast"] == {"round": 1, "worldSize": 3, "receivers": 2, "state": "Done"}
    cond = {c["type"]: c for c in st["conditions"]}
    assert cond["ReceiversReady"]["status"] == "False", cond
    for name in PODS:
        record = pod_record(fl, name)
        assert (record["version"], record["source"]) == ("B-bcast", "broadcast")
        # fp32 pods against B's fp32 reference: the broadcast loaded B exactly.
        assert record["probe"]["verdict"] == "Pass"
        assert record["probe"]["maxAbsLogprobDiff"] < 1e-4, record["probe"]
        # Nothing staged or read from files: the weights came in the receive step (a stage
        # that leaves the pod where it was is not recorded at all).
        assert record["step_seconds"]["receive"] > 0, record["step_seconds"]
        assert record["step_seconds"].get("stage", 0.0) < 0.05, record["step_seconds"]
    assert fl.serving(PODS, servers) == {p: ("B-bcast", True) for p in PODS}
    # Read back after the receive: both pods hold the same runtime weights.
    read = {(pod_record(fl, n)["layout"], pod_record(fl, n)["checksum"]) for n in PODS}
    assert len(read) == 1 and all(read.pop()), [pod_record(fl, n) for n in PODS]
    # A broadcast is no rollback target: the next refit's previous is still the checkpoint A.
    # Rolling, one pod at a time: one send per batch, the client loops by itself.
    out = train(
        fl, tiny_model, servers, "bcast-a", "A-bcast", tensors="A", reference="A",
        strategy="Rolling", max_unavailable=1,
    )  # fmt: skip
    assert out["phase"] == "Succeeded", (out, op.logs())
    assert [r["round"] for r in out["rounds"]] == [1, 2]
    assert out["status"]["broadcast"]["worldSize"] == 2
    assert out["status"]["previous"]["refit"] == "to-a"
    assert fl.serving(PODS, servers) == {p: ("A-bcast", True) for p in PODS}


def test_vllm_trainer_engine_refits_the_fleet_through_refit_client(
    fleet, servers, tiny_model, monkeypatch, capsys
):
    """vLLM's own trainer flow (WeightTransferTrainerFactory.trainer_init, send_weights) with
    the refit-gloo engine and Refit's VLLMWeightSyncClient, as examples/vllm_trainer_engine.py
    runs it (its command line first): one send refits both pods through the operator (one
    round, probed); a tensor changed after its promise is refused on both pods, which keep
    serving the version before, and send_weights raises with the operator's reason."""
    import torch
    from refit_client import RefitClient, RefitFailed
    from refit_client.refit_document import default_name
    from refit_worker.broadcast import gloo_trainer
    from transformers import AutoModelForCausalLM

    from examples.vllm_trainer_engine import fleet_engine, main, refit

    fl, op = fleet
    spec = {"port": servers[0].port, "admin_token_secret": ADMIN_SECRET,
            "sequence": {"sleepLevel": 1}}  # fmt: skip
    b = tiny_model.checkpoints["B"]
    argv = ["--model-dir", str(b), "--version", "B-engine", "--reference",
            str(b / "refit-probe.json"), "--rendezvous", f"127.0.0.1:{free_port('127.0.0.1')}",
            "--selector", "app=rollout", "--namespace", fl.ns, "--kubeconfig",
            str(fl.cp.kubeconfig), "--timeout", "300", "--spec", json.dumps(spec)]  # fmt: skip
    assert main(argv) == 0, (capsys.readouterr(), op.logs())
    assert capsys.readouterr().out.strip().endswith("B-engine: Succeeded")
    status = fl.refit(default_name("B-engine"))["status"]
    assert status["broadcast"] == {"round": 1, "worldSize": 3, "receivers": 2,
                                   "state": "Done"}  # fmt: skip
    for name in PODS:
        record = pod_record(fl, name)
        assert (record["version"], record["source"]) == ("B-engine", "broadcast")
        assert record["probe"]["verdict"] == "Pass", record
    assert fl.serving(PODS, servers) == {p: ("B-engine", True) for p in PODS}

    build = gloo_trainer.build_manifest

    def promise_then_corrupt(tensors: dict[str, Any]) -> Any:
        manifest = build(tensors)
        tensors[CORRUPTED].add_(1.0)  # the bytes sent are no longer the ones promised
        return manifest

    monkeypatch.setattr(gloo_trainer, "build_manifest", promise_then_corrupt)
    model = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32)
    with RefitClient(namespace=fl.ns, kubeconfig=fl.cp.kubeconfig) as refits:
        engine = fleet_engine(refits, model, ("127.0.0.1", free_port("127.0.0.1")),
                              fleet_selector="app=rollout", timeout=300, **spec)  # fmt: skip
        try:
            with pytest.raises(RefitFailed) as failed:
                refit(engine, "B-engine-2", tiny_model.reference("B"))
        finally:
            engine.shutdown()
    e = failed.value
    assert e.phase == "Halted", (e, op.logs())
    assert {(f.pod, f.reason) for f in e.pod_failures} == {(p, "TransferMismatch") for p in PODS}
    assert CORRUPTED in str(e), e
    for name in PODS:
        record = pod_record(fl, name)
        assert (record["reason"], record["restored"]) == ("TransferMismatch", True), record
    assert fl.serving(PODS, servers) == {p: ("B-engine", True) for p in PODS}


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("corrupt-after-promise", "TransferMismatch"),
        ("die-mid-send", "TransferFailed"),
        ("extra-rank", "TransferFailed"),
        ("slow-send", "TransferFailed"),
        ("silent", "TrainerTimeout"),
    ],
)
def test_a_failed_broadcast_leaves_the_pods_on_their_probed_weights(
    fleet, servers, tiny_model, fault, reason
):
    """Every receive is refused before the model is touched: each pod goes back to serving
    A (probed), the refit halts with the reason, nothing half-served."""
    fl, op = fleet
    out = train(
        fl, tiny_model, servers, f"bcast-{fault}", "B-bcast", tensors="B", reference="B",
        fault=fault, transfer_timeout=TRANSFER_TIMEOUT,
    )  # fmt: skip
    doc = fl.wait_phase(f"bcast-{fault}", ENDED, 180, op)
    st = doc["status"]
    assert st["phase"] == "Halted", (st, out, op.logs())
    assert st["failedPods"] == 2
    for name in PODS:
        record = pod_record(fl, name)
        assert record["reason"] == reason, record
        assert record["restored"] is True, record
    assert fl.serving(PODS, servers) == {p: ("A", True) for p in PODS}


def test_a_consistent_but_wrong_model_is_caught_by_the_probe_and_rolled_back(
    fleet, servers, tiny_model
):
    """The trainer sends A's tensors with A's promise but B's reference: the transfer checks
    pass, the probe fails, and Rollback reloads the last checkpoint the fleet served."""
    fl, op = fleet
    out = train(
        fl, tiny_model, servers, "bcast-wrong", "B-bcast", tensors="A", reference="B",
        on_failure="Rollback",
    )  # fmt: skip
    assert out["phase"] == "RolledBack", (out, op.logs())
    st = fl.refit("bcast-wrong")["status"]
    assert st["previous"] == {"version": "A", "path": str(tiny_model.checkpoints["A"]),
                              "refit": "to-a"}  # fmt: skip
    assert fl.serving(PODS, servers) == {p: ("A", True) for p in PODS}
    for name in PODS:
        record = pod_record(fl, name)
        assert (record["rollback"], record["version"]) == (True, "A"), record


@pytest.mark.failover
def test_a_manifest_gone_across_an_operator_restart_fails_closed_then_rolls_back(
    fleet, servers, tiny_model
):
    """Both pods wait in their round (drained, asleep) for a trainer that never sends; the
    operator is SIGKILLed and the transfer manifest's ConfigMap deleted before it restarts.
    The resumed passes cannot receive anything they could check: each fails with
    ManifestMissing (the pod out of traffic, not restored), and Rollback reloads A."""
    fl, op = fleet
    cmd = trainer_command(
        fl, tiny_model, servers, "bcast-gone", "B-bcast", tensors="B", reference="B",
        fault="silent", transfer_timeout=120, on_failure="Rollback",
    )  # fmt: skip
    trainer = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)  # fmt: skip
    try:

        def waiting() -> bool:
            try:
                status = fl.refit("bcast-gone").get("status") or {}
            except ApiException:
                return False
            b = status.get("broadcast") or {}
            return b.get("state") == "Ready" and b.get("receivers") == 2

        fl.wait_for(waiting, timeout=120, why="both pods to wait in the round")
        op.kill()
        manifest = fl.refit("bcast-gone")["spec"]["broadcast"]["manifest"]["configMapRef"]
        try:
            fl.core.delete_namespaced_config_map(manifest["name"], fl.ns)
        except ApiException as e:
            assert e.status == 404, e  # the trainer's client may have taken it already
        op.start()
        st = fl.wait_phase("bcast-gone", ENDED, 240, op)["status"]
    finally:
        trainer.kill()
        trainer.communicate(timeout=30)
    shown = {k: st.get(k) for k in ("phase", "conditions", "pods")}
    assert st["phase"] == "RolledBack", (json.dumps(shown), op.logs()[-3000:])
    failed = [e["message"] for e in fl.events("PodStepFailed")]
    for name in PODS:
        assert any(f"pod {name}: receive: ManifestMissing" in m for m in failed), failed
        record = pod_record(fl, name)
        assert (record["rollback"], record["version"], record["outcome"]) == (
            True, "A", "Succeeded"
        ), record  # fmt: skip
    assert fl.serving(PODS, servers) == {p: ("A", True) for p in PODS}


def test_read_back_checksums_agree_and_a_skewed_pod_fails_before_its_probe(
    fleet, servers, tiny_model
):
    """After the fixture's AllAtOnce refit to A both pods read back one checksum, which the
    refit records once. Then one pod's runtime tensors are skewed after every load: a
    parameter (one element of a norm's weight + 1e-4), then a buffer that is no parameter (the
    rotary cache).
    A Rolling refit reads back the other pod first; the skewed one fails with
    WeightChecksumMismatch at the checksum step, never probed, and stays out of traffic,
    while the probe alone (the same reference, thresholds and code) passes it."""
    import httpx
    from refit_operator.core.api_spec import Thresholds
    from refit_operator.core.probe import evaluate

    from tests.fixtures.reload import scores

    fl, op = fleet
    good, skewed = servers
    records = {n: pod_record(fl, n) for n in PODS}
    layout, digest = records["vllm-0"]["layout"], records["vllm-0"]["checksum"]
    assert layout and digest and records["vllm-0"]["step_seconds"]["checksum"] > 0
    assert {(r["layout"], r["checksum"]) for r in records.values()} == {(layout, digest)}
    st = fl.refit("to-a")["status"]
    assert st["checksums"] == [{"version": "A", "layout": layout, "digest": digest}]
    with httpx.Client(timeout=120) as http:
        parameters = skewed.rpc(http, "hazard_tensor_sizes", "parameter")
        buffers = skewed.rpc(http, "hazard_tensor_sizes", "buffer")
        # vLLM's /weight_checker hashes parameters only: the buffers are the worker's part.
        assert buffers and not set(buffers) & set(parameters), buffers
        # vLLM's CPU build moves every unquantized linear weight into a oneDNN (or SGL) pack
        # and leaves an empty parameter (model_executor/layers/utils.py,
        # dispatch_cpu_unquantized_gemm): on CPU the read-back sees embeddings, norms and
        # buffers, not the linear weights (docs/concepts.md, "Read-back checksums").
        empty = sorted(n for n, size in parameters.items() if size == 0)
        assert any(n.endswith("mlp.down_proj.weight") for n in empty), parameters
        # A norm's weight, and the rotary cache (a buffer no checkpoint carries).
        weight = next(p for p in parameters if p.endswith("post_attention_layernorm.weight"))
        rotary = next(b for b in buffers if b.endswith("rotary_emb.cos_sin_cache"))
        cases = [
            ("skew-parameter", "B", "parameter", weight),
            ("skew-buffer", "A", "buffer", rotary),
        ]
        try:
            for name, version, kind, tensor in cases:
                skewed.rpc(http, "hazard_clear_skews")
                skewed.rpc(http, "hazard_skew_after_load", kind, tensor, 1e-4)
                fl.apply_refit(
                    name, version, tiny_model.checkpoints[version], good.port,
                    fleet={"adminTokenSecretRef": {"name": "vllm-admin"}},
                    sequence={"sleepLevel": 1},
                    strategy={"type": "Rolling", "maxUnavailable": 1},
                )  # fmt: skip
                st = fl.wait_phase(name, ENDED, 180, op)["status"]
                assert st["phase"] == "Halted", (kind, st, op.logs())
                first, bad = pod_record(fl, "vllm-0"), pod_record(fl, "vllm-1")
                assert first["outcome"] == "Succeeded" and first["probe"]["verdict"] == "Pass"
                assert (bad["outcome"], bad["reason"]) == ("Failed", "WeightChecksumMismatch")
                assert bad["step"] == "checksum" and bad["probe"] is None, (kind, bad)
                assert bad["layout"] == first["layout"] and bad["checksum"] != first["checksum"]
                assert "vllm-0" in bad["message"], bad["message"]
                assert fl.ready(fl.pod("vllm-1")) is False
                assert st["pods"][0]["reason"] == "WeightChecksumMismatch"
                assert st["pods"][0]["checksum"] == bad["checksum"]
                assert st["checksums"] == [
                    {"version": version, "layout": first["layout"], "digest": first["checksum"]}
                ]
                # The probe alone would have let the skewed pod into traffic.
                ref = tiny_model.reference(version)
                verdict = evaluate(ref, scores(skewed, http, ref), Thresholds())
                assert verdict.verdict == "Pass", (kind, verdict)
        finally:
            skewed.rpc(http, "hazard_clear_skews")


def test_a_pod_that_dies_mid_receive_stays_out_and_the_other_serves_again(
    fleet, servers, tiny_model
):
    """The trainer stalls after the round's header; meanwhile one pod's vLLM dies inside its
    receive. The other pod's round breaks (TransferFailed) and it serves A again; the dead
    one stays out of traffic with a reason. Last in the module: it kills a server."""
    fl, op = fleet
    cmd = trainer_command(
        fl, tiny_model, servers, "bcast-dies", "B-bcast", tensors="B", reference="B",
        fault="stall-after-header", transfer_timeout=TRANSFER_TIMEOUT,
    )  # fmt: skip
    trainer = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)  # fmt: skip
    try:

        def sending() -> bool:
            try:  # the trainer process creates the refit once it has imported torch
                status = fl.refit("bcast-dies").get("status") or {}
            except ApiException:
                return False
            return (status.get("broadcast") or {}).get("state") == "Sending"

        fl.wait_for(sending, timeout=120, why="the trainer to announce its round")
        time.sleep(2.0)  # both pods are inside /update_weights, the header received
        os.killpg(servers[1].process.pid, signal.SIGKILL)
        trainer.communicate(timeout=300)
    finally:
        trainer.kill()
    st = fl.wait_phase("bcast-dies", ENDED, 180, op)["status"]
    assert st["phase"] == "Halted", (st, op.logs())
    alive, dead = pod_record(fl, PODS[0]), pod_record(fl, PODS[1])
    # The live pod either lost the round with its peer (refused before its model was
    # touched: A again) or had received all of it from the trainer before the trainer hit
    # the dead peer (checked and probed: B). Either way it serves a probed version.
    restored = (alive["reason"], alive["restored"]) == ("TransferFailed", True)
    loaded = (alive["outcome"], alive["version"]) == ("Succeeded", "B-bcast")
    assert restored or loaded, alive
    assert fl.ready(fl.pod(PODS[0])) is True
    assert dead["outcome"] == "Failed" and not dead["restored"], dead
    assert dead["reason"] in ("PodUnreachable", "ReceiveTimeout"), dead
    assert fl.ready(fl.pod(PODS[1])) is False
