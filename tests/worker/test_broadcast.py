"""Broadcast refits on a real vLLM CPU server: the refit-gloo engine driven by vLLM's own RL
router, this test process as the trainer (refit_worker.broadcast.Sender).

The server starts from A's files with --weight-transfer-config '{"backend": "refit-gloo"}'.
A broadcast of B's tensors with B's promise loads B: the probe against B's reference passes,
refit_received reports exactly the promised manifest, and the parameters are bit for bit those
of a file refit of B (vLLM's /weight_checker). Broadcasts that differ from their promise (a
corrupted tensor, a promised tensor not sent, a promise without a tensor the model needs, a
malformed promise) and a trainer that never sends are refused with their code, and the model
is untouched (same checksums, same scores); the next broadcast loads. Finally vLLM's own
trainer-side flow (WeightTransferTrainerFactory) drives the same engine.

One server for the module, world size 2 (the trainer and the server's one worker).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from refit_worker import broadcast
from refit_worker.contract import TRANSFER_BACKEND, parse_rejection

from testbed.tiny_model import TinyModel
from testbed.vllm_server import VllmServer, start_vllm_server
from tests.fixtures.broadcast import (
    Tensors,
    checksums,
    connect,
    post,
    refit_by_broadcast,
    send_round,
    verdict,
)
from tests.fixtures.reload import admin, refit_cycle, rejection, scores

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CORRUPTED = "model.layers.0.mlp.down_proj.weight"
UNSENT = "model.norm.weight"


@pytest.fixture(scope="module")
def vllm_server(tiny_model: TinyModel) -> Iterator[VllmServer]:
    """This module's server: started from A's files, with the refit-gloo engine."""
    config = json.dumps({"backend": TRANSFER_BACKEND})
    with start_vllm_server(
        tiny_model,
        api_key="test-api-key",
        load_format="safetensors",
        model_dir=tiny_model.checkpoints["A"],
        extra_args=["--weight-transfer-config", config],
    ) as server:
        yield server


@pytest.fixture(scope="module")
def tensors(tiny_model: TinyModel) -> dict[str, Tensors]:
    return {name: broadcast.load_tensors(tiny_model.checkpoints[name]) for name in ("A", "B")}


class RouterClient:
    """vLLM's VLLMWeightSyncClient protocol over the server's RL router. vLLM's own
    HTTPVLLMWeightSyncClient sends no credentials, and the admin guard requires them."""

    def __init__(self, server: VllmServer) -> None:
        self.server = server

    def _post(self, path: str, body: Any = None) -> None:
        r = post(self.server, path, body)
        assert r.status_code == 200, f"{path}: {r.status_code} {r.text[:300]}"

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post("/start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("/finish_weight_update", {"weight_version": weight_version})


@pytest.fixture(scope="module")
def sender(vllm_server: VllmServer) -> Iterator[broadcast.Sender]:
    sender = connect(vllm_server)
    yield sender
    sender.close()


def test_a_broadcast_of_B_loads_B_and_passes_its_probe(
    vllm_server: VllmServer,
    tiny_model: TinyModel,
    http: httpx.Client,
    sender: broadcast.Sender,
    tensors: dict[str, Tensors],
) -> None:
    ref_a, ref_b = tiny_model.reference("A"), tiny_model.reference("B")
    assert verdict(vllm_server, http, ref_a)[0] == "Pass"  # started from A's files
    assert verdict(vllm_server, http, ref_b)[0] == "Fail"
    refit_by_broadcast(vllm_server, http, sender, tensors["B"], "B")
    got, message = verdict(vllm_server, http, ref_b)
    assert got == "Pass", message
    assert admin(vllm_server, http, "GET", "/weight_info")["weight_version"] == "B"
    assert vllm_server.rpc(http, "refit_info")["weight_version"] == "B"


def test_the_broadcast_weights_are_bit_identical_to_a_file_refit(
    vllm_server: VllmServer,
    tiny_model: TinyModel,
    http: httpx.Client,
    sender: broadcast.Sender,
    tensors: dict[str, Tensors],
) -> None:
    refit_cycle(vllm_server, http, str(tiny_model.checkpoints["A"]), "A")
    from_a = checksums(vllm_server, http)
    refit_by_broadcast(vllm_server, http, sender, tensors["B"], "B")
    by_broadcast = checksums(vllm_server, http)
    refit_cycle(vllm_server, http, str(tiny_model.checkpoints["B"]), "B-file")
    assert by_broadcast == checksums(vllm_server, http)
    assert from_a != by_broadcast


def corrupted(b: Tensors) -> Tensors:
    bad = dict(b)
    bad[CORRUPTED] = b[CORRUPTED].clone()
    bad[CORRUPTED][0, 0] += 1.0
    return bad


def without(b: Tensors, name: str) -> Tensors:
    return {n: t for n, t in b.items() if n != name}


# case -> (the promise, what the trainer sends, the refusal's code, the start of its detail)
REFUSALS: dict[str, Any] = {
    "corrupted": (
        lambda b: broadcast.build_manifest(b).to_json_dict(),
        corrupted,
        "TransferMismatch",
        f"{CORRUPTED}: its bytes differ from the promise",
    ),
    "promised-not-sent": (
        lambda b: broadcast.build_manifest(b).to_json_dict(),
        lambda b: without(b, UNSENT),
        "TransferMismatch",
        f"promised but not sent: {UNSENT}",
    ),
    "promise-lacks-a-parameter": (
        lambda b: broadcast.build_manifest(without(b, UNSENT)).to_json_dict(),
        lambda b: without(b, UNSENT),
        "TensorMismatch",
        f"the checkpoint lacks {UNSENT}",
    ),
    "malformed-promise": (
        lambda b: {**broadcast.build_manifest(b).to_json_dict(), "blake3": "0" * 64},
        lambda b: b,
        "ManifestInvalid",
        "transfer manifest: blake3 0000",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_broadcast_unlike_its_promise_is_refused_and_the_model_untouched(
    vllm_server: VllmServer,
    tiny_model: TinyModel,
    http: httpx.Client,
    sender: broadcast.Sender,
    tensors: dict[str, Tensors],
    case: str,
) -> None:
    make_promise, make_sent, code, detail = REFUSALS[case]
    ref_a = tiny_model.reference("A")
    refit_by_broadcast(vllm_server, http, sender, tensors["A"], "A")
    before = (checksums(vllm_server, http), scores(vllm_server, http, ref_a))
    answer, _ = send_round(vllm_server, sender, make_promise(tensors["B"]), make_sent(tensors["B"]))
    assert answer.status_code == 500
    got_code, got_detail = parse_rejection(answer.text) or ("", answer.text[:300])
    assert got_code == code and got_detail.startswith(detail), got_detail
    # The record says the same, whatever digest is asked for, and the update is over.
    assert rejection(vllm_server, http, "refit_received", "") == (got_code, got_detail)
    assert post(vllm_server, "/finish_weight_update").status_code == 500  # no update open
    assert (checksums(vllm_server, http), scores(vllm_server, http, ref_a)) == before
    assert admin(vllm_server, http, "GET", "/weight_info")["weight_version"] == "A"


def test_after_refusals_the_next_broadcast_loads(
    vllm_server: VllmServer,
    tiny_model: TinyModel,
    http: httpx.Client,
    sender: broadcast.Sender,
    tensors: dict[str, Tensors],
) -> None:
    answer, _ = send_round(vllm_server, sender, {"formatVersion": 1}, tensors["B"])
    assert answer.status_code == 500
    refit_by_broadcast(vllm_server, http, sender, tensors["B"], "B-again")
    got, message = verdict(vllm_server, http, tiny_model.reference("B"))
    assert got == "Pass", message
    # refit_received with another digest: the pod did not load that one.
    code, detail = rejection(vllm_server, http, "refit_received", "f" * 64)
    assert code == "TransferMismatch" and detail.endswith(f"not {'f' * 64}"), detail


def test_a_trainer_that_never_sends_is_refused_after_the_timeout(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client, tensors: dict[str, Tensors]
) -> None:
    ref_b = tiny_model.reference("B")
    before = (checksums(vllm_server, http), scores(vllm_server, http, ref_b))
    with connect(vllm_server, timeout_seconds=3):  # replaces the module's group
        assert post(vllm_server, "/start_weight_update").status_code == 200
        promise = broadcast.build_manifest(tensors["A"]).to_json_dict()
        started = time.perf_counter()
        answer = post(vllm_server, "/update_weights", {"update_info": {"manifest": promise}})
        waited = time.perf_counter() - started
    assert answer.status_code == 500 and 3 <= waited < 60, (answer.status_code, waited)
    code, detail = parse_rejection(answer.text) or ("", "")
    assert code == "TransferFailed" and "gloo broadcast failed" in detail, detail
    assert (checksums(vllm_server, http), scores(vllm_server, http, ref_b)) == before
    # The broken group is gone: the next update is refused at once, until an init.
    assert post(vllm_server, "/start_weight_update").status_code == 200
    answer = post(vllm_server, "/update_weights", {"update_info": {"manifest": promise}})
    code, detail = parse_rejection(answer.text) or ("", "")
    assert code == "TransferFailed" and detail.startswith("not initialized"), detail
    # An init whose rank is not a receiver's is refused with the same code.
    init = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0, "world_size": 2}
    answer = post(vllm_server, "/init_weight_transfer_engine", {"init_info": init})
    code, detail = parse_rejection(answer.text) or ("", "")
    assert code == "TransferFailed" and detail.endswith("not a receiver's rank"), detail


def test_vllm_trainer_factory_drives_the_router(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client, tensors: dict[str, Tensors]
) -> None:
    from refit_worker.broadcast.gloo_trainer import GlooTrainerInitInfo
    from refit_worker.plugin import register_transfer_engines
    from vllm.distributed.weight_transfer import (
        ParamMeta,
        WeightSource,
        WeightTransferTrainerFactory,
    )

    class DictSource(WeightSource):  # ModuleSource needs an nn.Module
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors["A"].items()]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return iter(tensors["A"].items())

    register_transfer_engines()
    engine = WeightTransferTrainerFactory.trainer_init(
        GlooTrainerInitInfo(rank=0, world_size=2, timeout_seconds=120),
        client=RouterClient(vllm_server),
        source=DictSource(),
    )
    try:
        engine.send_weights()
        digest = engine.last_manifest.digest  # type: ignore[attr-defined]
    finally:
        engine.shutdown()
    received = vllm_server.rpc(http, "refit_received", digest, "A-factory")
    assert (received["state"], received["digest"]) == ("loaded", digest)
    got, message = verdict(vllm_server, http, tiny_model.reference("A"))
    assert got == "Pass", message
