"""spec.adapter on real parts: the `refit-operator` process on the real API server refits a
LoRA adapter on a real vLLM CPU server (runtime LoRA updating on, base checkpoint A) with the
tiny adapters the test bed builds (testbed/tiny_adapter.py).

What it holds: an adapter refit succeeds through the operator with its probe scored through
the adapter against the trainer's reference (base + adapter merged); the pod is out of traffic
only for the swap (no sleep, wake or reload: the base model's weight version stays); a second
adapter version keeps the first serving until its staged probe passed; a wrong adapter fails
its staged probe with the old one still serving and the pod never out of traffic; the pod's
records keep the adapter apart from the base weights; and a refit of the base weights on the
same LoRA-enabled pod passes its probe, scored one prompt per request (a batch kills that
engine)."""

from __future__ import annotations

import httpx
import pytest
from refit_worker.contract import READINESS_GATE

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

        st = adapter_refit("lora-v1", "v1")
        assert st["phase"] == "Succeeded", (st, op.logs())
        first = record()
        assert (first["refit"], first["version"], first["source"]) == ("lora-v1", "v1", "adapter")
        assert first["probe"]["verdict"] == "Pass" and first["probe"]["maxAbsLogprobDiff"] < 0.05
        assert set(first["step_seconds"]) <= ADAPTER_STEPS  # no sleep, wake or reload
        assert fleet.progress(fleet.pod("vllm-0")) is None  # the base weights' record: none
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
        assert info.json()["weight_version"] == "default"  # the base model was never reloaded

        st = adapter_refit("lora-wrong", "wrong")
        assert st["phase"] == "Halted", (st, op.logs())
        bad = record()
        assert bad["outcome"] == "Failed" and bad["restored"] and bad["reason"] == "LogprobDrift"
        assert not bad["left_traffic"]  # it never left traffic: v2 served throughout
        pod = fleet.pod("vllm-0")
        cond = next(c for c in pod["status"]["conditions"] if c["type"] == READINESS_GATE)
        assert (cond["status"], cond["reason"]) == ("True", "PreviousAdapter"), cond

        # The base weights' own refit on the same LoRA-enabled pod: its probe (one prompt per
        # request) passes, and the adapter's record is left as it was.
        st = fleet.refit_server_pods(
            op, "base-a", "A", tiny_model.checkpoints["A"], server.port, timeout=240
        )
        assert st["phase"] == "Succeeded", (st, op.logs())
        base = fleet.progress(fleet.pod("vllm-0"))
        assert base is not None and base["probe"]["verdict"] == "Pass"
        assert record() == bad
