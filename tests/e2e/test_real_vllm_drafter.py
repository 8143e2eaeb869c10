"""A speculative drafter refitted with its target through the operator, on real parts: the
`refit-operator` process on the real API server and one real vLLM CPU server running the tiny
model as its own `draft_model` drafter (2 speculative tokens).

What it holds: a refit whose checkpoint carries the drafter's weights (drafter/) Succeeds with
the drafter's greedy acceptance on the probe prompts recorded (about 1.0: the drafter drafts
as the target decodes); a checkpoint whose drafter/ holds another version's weights passes
the target's probe but fails the drafter's (DraftAcceptanceLow) and stays out of traffic; a
checkpoint without drafter/ is refused before either model is touched (DrafterMissing), and
the pod serves on. A broadcast sends the drafter's tensors beside the target's: the same
judgement holds for it (a trainer process, `testbed.broadcast_trainer --drafter`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from refit_worker.contract import READINESS_GATE, TRANSFER_BACKEND

from testbed.vllm_server import start_vllm_server
from tests.fixtures.reload import checkpoint_with
from tests.fixtures.trainer import train

pytestmark = [pytest.mark.cluster, pytest.mark.vllm, pytest.mark.timeout(900)]


def test_a_drafter_is_refitted_with_its_target_and_judged(harness, tiny_model, tmp_path):
    fleet, op = harness
    a, b = tiny_model.checkpoints["A"], tiny_model.checkpoints["B"]
    root = tmp_path / "checkpoints"
    root.mkdir()
    ckpt = {
        "B": checkpoint_with(root, "B", b, b),
        "A": checkpoint_with(root, "A", a, a),
        "B-stale": checkpoint_with(root, "B-stale", b, a),  # A's drafter beside B
        "B-none": checkpoint_with(root, "B-none", b, None),
    }
    drafter = {"method": "draft_model", "model": str(a), "num_speculative_tokens": 2}
    engine = json.dumps({"backend": TRANSFER_BACKEND})  # broadcasts too
    with start_vllm_server(
        tiny_model, host="127.0.0.1", load_format="safetensors", model_dir=a,
        extra_args=["--speculative-config", json.dumps(drafter),
                    "--weight-transfer-config", engine],
        env={"REFIT_ALLOWED_ROOT": str(root)},
    ) as server:  # fmt: skip
        fleet.add_server_pods(["vllm-0"], [server])
        op.start()

        def refit(name: str, version: str, key: str) -> dict:
            return fleet.refit_server_pods(op, name, version, ckpt[key], server.port,
                                           timeout=240)  # fmt: skip

        def record() -> dict:
            rec = fleet.progress(fleet.pod("vllm-0"))
            assert rec is not None
            return rec

        st = refit("to-b", "B", "B")
        assert st["phase"] == "Succeeded", (st, op.logs())
        rec = record()
        assert rec["drafter"] == "draft_model"
        assert rec["probe"]["draftAcceptance"] >= 0.99, rec["probe"]
        assert fleet.ready(fleet.pod("vllm-0")) is True

        st = refit("to-b-stale", "B-stale", "B-stale")
        assert st["phase"] == "Halted", (st, op.logs())
        bad = st["pods"][0]
        assert (bad["phase"], bad["reason"]) == ("Failed", "DraftAcceptanceLow"), bad
        # The target passed: only the drafter's acceptance tells (measured 0.32).
        assert bad["probe"]["maxAbsLogprobDiff"] < 1e-3 and bad["probe"]["draftAcceptance"] < 0.6
        assert fleet.ready(fleet.pod("vllm-0")) is False

        st = refit("to-a", "A", "A")
        assert st["phase"] == "Succeeded", (st, op.logs())
        assert record()["probe"]["draftAcceptance"] >= 0.99

        st = refit("to-b-none", "B-none", "B-none")
        assert st["phase"] == "Halted", (st, op.logs())
        rec = record()
        assert (rec["outcome"], rec["reason"], rec["step"]) == ("Failed", "DrafterMissing",
                                                                "stage"), rec  # fmt: skip
        assert not rec["left_traffic"] and Path(rec["serving_path"]) == ckpt["A"]
        pod = fleet.pod("vllm-0")
        cond = next(c for c in pod["status"]["conditions"] if c["type"] == READINESS_GATE)
        # Refused while staging: the pod never left traffic, A (probed) serves on.
        assert (cond["status"], cond["message"]) == ("True", "weights A probed"), cond

        # By broadcast: B's target with B's drafter, then with A's (stale) drafter.
        said = train(fleet, tiny_model, [server], "bcast-b", "B-sent", tensors="B",
                     reference="B", drafter="B")  # fmt: skip
        assert said["phase"] == "Succeeded", (said, op.logs())
        rec = record()
        assert (rec["source"], rec["version"]) == ("broadcast", "B-sent")
        assert rec["probe"]["draftAcceptance"] >= 0.99, rec["probe"]
        said = train(fleet, tiny_model, [server], "bcast-stale", "B-stale-sent", tensors="B",
                     reference="B", drafter="A")  # fmt: skip
        assert said["phase"] == "Halted" and said["reason"] == "FailureLimitExceeded", said
        rec = record()
        assert (rec["outcome"], rec["reason"]) == ("Failed", "DraftAcceptanceLow"), rec
