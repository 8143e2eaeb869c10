"""The operator's index of WeightRefits converges to what the API server has: a refit whose
DELETED event never reached the operator (a watch that relisted) is dropped, and neither
blocks its fleet's queue nor keeps its claims looking live."""

from __future__ import annotations

import pytest

from testbed.apiproxy import WatchEventDropper
from testbed.fleet import make_checkpoints, start_fleet

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def test_a_refit_deleted_unseen_does_not_block_its_fleet(
    harness, sim_fleet, tmp_path, control_plane
):
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, 2)
    sims[0].fleet.set_fault("refit_load", "delay", 3.0)
    ckpt = make_checkpoints(tmp_path, "v1", "v2")
    with WatchEventDropper(control_plane) as proxy:
        op.kubeconfig = proxy.kubeconfig
        op.start()
        fleet.apply_refit("wr-a", "v1", ckpt["v1"], sims[0].port)
        fleet.wait_serving(sims[0], "refit_load", timeout=30)
        # Deleted mid-way: the finalizer lets go once the passes in flight end, and the
        # operator never hears that the object is gone. To it, wr-a is still in progress.
        proxy.drop("DELETED", "wr-a")
        fleet.custom.delete_namespaced_custom_object(
            "refit.rollout.dev", "v1alpha1", fleet.ns, "weightrefits", "wr-a"
        )

        def gone() -> bool:
            return "wr-a" not in [
                i["metadata"]["name"]
                for i in fleet.custom.list_namespaced_custom_object(
                    "refit.rollout.dev", "v1alpha1", fleet.ns, "weightrefits"
                )["items"]
            ]

        fleet.wait_for(gone, 60, "the finalizer to let go")
        fleet.wait_for(lambda: ("DELETED", "wr-a") in proxy.dropped, 10, "the lost event")
        fleet.apply_refit("wr-b", "v2", ckpt["v2"], sims[0].port)
        st = fleet.wait_phase("wr-b", {"Succeeded", "Failed", "Halted"}, 60, op)["status"]
        assert st["phase"] == "Succeeded", st
        assert all(s.state()["weight_version"] == "v2" for s in sims)
        op.stop_all()
