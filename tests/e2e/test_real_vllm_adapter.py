"""spec.adapter on real parts: the `refit-operator` process on the real API server refits a
LoRA adapter on a real vLLM CPU server (runtime LoRA updating on, base checkpoint A) with the
tiny adapters the test bed builds (testbed/tiny_adapter.py).

What it holds: an adapter refit succeeds through the operator with its probe scored through
the adapter against the trainer's reference (base + adapter merged); the pod is out of traffic
only for the swap (no sleep, wake or reload: the base model's weight version stays); a second
adapter version keeps the first serving until its staged probe passed; a wrong adapter fails
its staged probe with the old one still serving and the pod never out of traffic; the pod's
records keep the adapter apart from the base weights. Where the tracks meet (one gate over
everything the pod serves, core/gate.py): the first adapter of a fleet, refused for a missing
PEFT config, never takes the base weights out of traffic; an adapter that fails after its swap
holds the pod out through a refit of the base weights (which passes, and unloads the adapter
at its drain) until a refit of the adapter brings it back."""

from __future__ import annotations

import shutil
import uuid

import httpx
import pytest
from refit_worker.contract import READINESS_GATE

from testbed.fleet import ADMIN_SECRET
from testbed.tiny_adapter import ensure_tiny_adapters
from testbed.vllm_server import start_vllm_server

pytestmark = [pytest.mark.cluster, pytest.mark.vllm, pytest.mark.timeout(900)]

SERVED = "policy"
LORA_ARGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
ADAPTER_STEPS = {"stage", "loadAdapter", "probeStaged", "drain", "swap", "resetCache", "probe",
                 "ready"}  # fmt: skip


def test_adapter_refits_through_the_operator(harness, tiny_model):
    fleet, op = harness
    adapters = ensure_tiny_adapters(tiny_model)
    with start_vllm_server(
        tiny_model, host="127.0.0.1", load_format="safetensors",
        model_dir=tiny_model.checkpoints["A"], extra_args=LORA_ARGS, env=LORA_ENV,
    ) as server:  # fmt: skip
        fleet.add_server_pods(["vllm-0"], [server])
        op.start()

        def adapter_refit(name: str, version: str) -> dict:
            return fleet.refit_server_pods(
                op, name, version, adapters.dir(version), server.port, adapter=SERVED,
                timeout=240,
            )  # fmt: skip

        def record() -> dict:
            rec = fleet.adapter_progress(fleet.pod("vllm-0")).get(SERVED)
            assert rec is not None
            return rec

        def condition() -> dict:
            pod = fleet.pod("vllm-0")
            return next(c for c in pod["status"]["conditions"] if c["type"] == READINESS_GATE)

        def loaded() -> list[str]:
            doc = httpx.get(server.base_url + "/v1/models").json()
            return sorted(m["id"] for m in doc["data"] if m.get("parent"))

        # The base weights first: no pod is in traffic before a pass probed them (NotProbed).
        st = fleet.refit_server_pods(
            op, "base-a", "A", tiny_model.checkpoints["A"], server.port, timeout=240
        )
        assert st["phase"] == "Succeeded", (st, op.logs())
        base = fleet.progress(fleet.pod("vllm-0"))
        assert base is not None and base["probe"]["verdict"] == "Pass"  # one prompt a request

        # The first adapter of the fleet, without its PEFT config: refused, and the base
        # weights serve throughout (issue 41: a bad first adapter stranded the fleet).
        scratch = tiny_model.allowed_root / f"gate-e2e-{uuid.uuid4().hex[:8]}"
        noconfig = scratch / "noconfig"
        shutil.copytree(adapters.dir("v1"), noconfig)
        (noconfig / "adapter_config.json").unlink()
        fleet.max_out_of_traffic = 0
        st = fleet.refit_server_pods(op, "lora-noconfig", "noconfig", noconfig, server.port,
                                     adapter=SERVED, timeout=240)  # fmt: skip
        assert st["phase"] in ("Failed", "Halted"), (st, op.logs())
        assert "AdapterInvalid" in str(st), st
        assert fleet.max_out_of_traffic == 0 and fleet.ready(fleet.pod("vllm-0")) is True
        assert loaded() == []

        st = adapter_refit("lora-v1", "v1")
        assert st["phase"] == "Succeeded", (st, op.logs())
        first = record()
        assert (first["refit"], first["version"], first["source"]) == ("lora-v1", "v1", "adapter")
        assert first["probe"]["verdict"] == "Pass" and first["probe"]["maxAbsLogprobDiff"] < 0.05
        assert set(first["step_seconds"]) <= ADAPTER_STEPS  # no sleep, wake or reload
        assert first["base_version"] == "A"  # the base it was probed on
        assert fleet.progress(fleet.pod("vllm-0")) == base  # the base weights' record: untouched
        assert fleet.ready(fleet.pod("vllm-0")) is True

        st = adapter_refit("lora-v2", "v2")
        assert st["phase"] == "Succeeded", (st, op.logs())
        assert st["previous"]["version"] == "v1"  # the adapter track's own rollback target
        second = record()
        assert (second["version"], second["serving"]) == ("v2", "v1")
        # Out of traffic only from the drain to the probe through the served name.
        assert 0 < second["left_traffic"] and second["step_seconds"]["probeStaged"] > 0
        out = st["outOfTraffic"]
        assert out["pods"] == 1 and out["worstSeconds"] < 10, out
        info = httpx.get(server.base_url + "/weight_info", headers=server.admin_headers())
        assert info.json()["weight_version"] == "A"  # the base model was never reloaded
        assert loaded() == [SERVED]  # nothing staged outlives a pass

        st = adapter_refit("lora-wrong", "wrong")
        assert st["phase"] == "Halted", (st, op.logs())
        bad = record()
        assert bad["outcome"] == "Failed" and bad["restored"] and bad["reason"] == "LogprobDrift"
        assert not bad["left_traffic"]  # it never left traffic: v2 served throughout
        cond = condition()
        assert (cond["status"], cond["reason"]) == ("True", "PreviousAdapter"), cond
        assert loaded() == [SERVED]

        # An adapter that fails after its swap: v1's files, changed while the pass waits out
        # its drain delay (after the staged probe passed, before the swap checks them again).
        late = scratch / "late"
        shutil.copytree(adapters.dir("v1"), late)
        fleet.apply_refit("lora-late", "late", late, server.port, adapter=SERVED,
                          fleet={"adminTokenSecretRef": {"name": ADMIN_SECRET}},
                          sequence={"sleepLevel": 1, "drainDelaySeconds": 5})  # fmt: skip
        fleet.wait_for(lambda: fleet.ready(fleet.pod("vllm-0")) is False, 120, "out to swap")
        with (late / "adapter_model.safetensors").open("r+b") as f:
            f.seek(-3, 2)
            byte = f.read(1)
            f.seek(-3, 2)
            f.write(bytes([byte[0] ^ 0xFF]))
        st = dict(fleet.wait_phase("lora-late", {"Halted", "Failed"}, 240, op)["status"])
        failed = record()
        assert failed["outcome"] == "Failed" and failed["left_traffic"] > 0, failed
        assert not failed["restored"] and condition()["status"] == "False"

        # A refit of the base weights passes on the pod (and unloads every adapter at its
        # drain), but the failed adapter's record keeps the pod out of traffic.
        st = fleet.refit_server_pods(
            op, "base-a2", "A", tiny_model.checkpoints["A"], server.port, timeout=240
        )
        assert st["phase"] == "Succeeded", (st, op.logs())
        cond = condition()
        assert (cond["status"], cond["reason"]) == ("False", failed["reason"]), cond
        assert f"adapter {SERVED} late failed" in cond["message"]
        assert loaded() == []

        # A refit of the adapter brings it back: the track's record passes again.
        st = adapter_refit("lora-v2b", "v2")
        assert st["phase"] == "Succeeded", (st, op.logs())
        assert fleet.ready(fleet.pod("vllm-0")) is True and loaded() == [SERVED]
        shutil.rmtree(scratch, ignore_errors=True)
