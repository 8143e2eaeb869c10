"""The whole product on real parts: the `refit-operator` process on the real API server
refits a real vLLM CPU server (plugin, admin guard, worker extension) to checkpoint A, then B,
and refuses a mixed checkpoint whose weights do not match its reference."""

from __future__ import annotations

import pytest

from testbed.vllm_server import start_vllm_server

pytestmark = [pytest.mark.cluster, pytest.mark.vllm, pytest.mark.timeout(900)]


def test_real_vllm_pod_through_the_full_sequence(harness, tiny_model):
    fleet, op = harness
    with start_vllm_server(tiny_model, host="127.0.0.1") as server:
        fleet.add_server_pods(["vllm-0"], [server])
        op.start()
        ckpts = tiny_model.checkpoints

        st = fleet.refit_server_pods(op, "to-a", "A", ckpts["A"], server.port, timeout=180)
        assert st["phase"] == "Succeeded", (st, op.logs())
        # A pod that succeeded is not listed in the status: its record is on the pod.
        assert st["pods"] == []
        pod = fleet.progress(fleet.pod("vllm-0"))
        assert pod is not None and pod["refit"] == "to-a"
        assert pod["version"] == "A" and pod["probe"]["verdict"] == "Pass"
        # fp32 server against an fp32 reference: agreement far inside the bf16 defaults.
        assert pod["probe"]["maxAbsLogprobDiff"] < 1e-3
        assert abs(pod["probe"]["nll"] - pod["probe"]["referenceNll"]) < 1e-3
        assert fleet.ready(fleet.pod("vllm-0")) is True
        nll_a = pod["probe"]["nll"]

        st = fleet.refit_server_pods(op, "to-b", "B", ckpts["B"], server.port, timeout=180)
        assert st["phase"] == "Succeeded", (st, op.logs())
        assert st["previous"]["version"] == "A"
        pod = fleet.progress(fleet.pod("vllm-0"))
        assert pod is not None and (pod["refit"], pod["version"]) == ("to-b", "B")
        assert pod["probe"]["nll"] != pytest.approx(nll_a, abs=1e-3)

        # Mixed weights with A's reference: the load works, only the probe can tell.
        st = fleet.refit_server_pods(
            op, "to-mixed", "mixed", ckpts["mixed"], server.port, timeout=180
        )
        assert st["phase"] == "Halted", (st, op.logs())
        bad = st["pods"][0]
        assert bad["phase"] == "Failed" and bad["probe"]["verdict"] == "Fail", bad
        assert fleet.ready(fleet.pod("vllm-0")) is False
