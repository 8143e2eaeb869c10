"""GPU check of Refit's VLLMWeightSyncClient (refit_client.weight_sync) under vLLM's trainer
engines, the trainer's model on the GPU.

Run on a machine with an NVIDIA GPU and vLLM with CUDA, from the repository root with the
test venv (transformers: the tiny model is built locally, nothing is downloaded):

    PYTHONPATH=operator:worker_image:sdk:. python tests/gpu/check_weight_sync_client.py

``--device cpu`` runs what needs no GPU (gloo-from-device, the model on the CPU) and skips
the rest, so the script itself can be checked anywhere. No cluster: the operator's side is
scripted (tests.fixtures.scripted_refits: one round, a world of the trainer and one pod's
worker), and that worker is a thread of this process receiving as refit-gloo's rank 1
(refit_worker.broadcast.receive), each tensor checked against the promise the refit pins.
The real operator and vLLM pods run the same client on CPU in
tests/e2e/test_broadcast_refit.py. Checks, printed as PASS / FAIL / SKIP / INFO like
check_broadcast.py:

  nccl-refused      vLLM's NCCL trainer engine (WeightTransferTrainerFactory.trainer_init
                    with NCCLTrainerInitInfo) through the client is refused at trainer_init
                    with a RefitError naming refit-gloo, and no refit is created: NCCL opens
                    one group of trainer + workers for the trainer's life, while a fleet's
                    worlds are the operator's rounds (the operator's pods receive refit-gloo
                    only). Its world here is the trainer alone (world_size 1): the engine
                    calls the client on a side thread while it opens its own endpoint, so
                    with a bigger world the refusal surfaces only once that endpoint's
                    rendezvous times out (no pod ever joins).
  gloo-from-device  the supported path for a GPU trainer: refit-gloo's trainer engine through
                    the same client, its source the tiny model on the device: one
                    send_weights is one refit with one announced round of world 2, the
                    worker receives every tensor as promised and equal to the model's, and
                    the verdict (Succeeded) is the client's last_status.

Exit status: 0 when nothing FAILED, 1 when a check FAILED, 2 when the environment cannot
run the check (SKIP with the reason). Not a pytest module; CI never runs it (no GPU there).
"""

from __future__ import annotations

import argparse
import sys
import threading
import traceback
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Refit's weight-sync client under vLLM's engines")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    device = p.parse_args(argv).device
    try:
        import torch

        if device == "cuda" and not torch.cuda.is_available():
            print("[SKIP] environment: no CUDA device (--device cpu runs gloo-from-device)")
            return 2
        from refit_client.refit_error import RefitError
        from refit_client.weight_sync import RefitWeightSyncClient
        from refit_worker.broadcast import Group, Verifier, receive
        from refit_worker.broadcast.gloo_trainer import GlooTrainerInitInfo
        from refit_worker.plugin import register_transfer_engines
        from transformers import AutoModelForCausalLM
        from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

        from testbed.tiny_model import ensure_tiny_model
        from testbed.vllm_server import free_port
        from tests.fixtures.scripted_refits import ScriptedRefits, ready
        from tests.gpu.check_flashinfer_fp8_reload import Report
    except ImportError as e:
        print(f"[SKIP] environment: {e}", flush=True)
        return 2

    report = Report()
    tiny = ensure_tiny_model()
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoints["B"], dtype=torch.float32)
    model.to(device)
    register_transfer_engines()
    reference = tiny.reference("B")

    if device != "cuda":
        report.add("nccl-refused", "SKIP", "NCCL's trainer endpoint needs a CUDA device")
    else:
        try:
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            refits = ScriptedRefits()
            client = RefitWeightSyncClient(refits, fleet_selector="app=rollout", timeout=60)
            init = NCCLTrainerInitInfo(
                rank=0, master_address="127.0.0.1", master_port=free_port("127.0.0.1"),
                world_size=1,
            )  # fmt: skip
            try:
                engine = WeightTransferTrainerFactory.trainer_init(
                    init, client=client, source=ModuleSource(model)
                )
                refused = "not refused: trainer_init returned an engine"
            except RefitError as e:
                refused = str(e)
            ok = "refit-gloo" in refused and not refits.created and not refits.log
            report.check("nccl-refused", ok, f"{refused}; refits created: {len(refits.created)}")
        except Exception:  # a crash is a failed check, with its traceback
            traceback.print_exc()
            report.add("nccl-refused", "FAIL", "the check crashed (traceback above)")

    try:
        port = free_port("127.0.0.1")
        got: dict[str, Any] = {}
        verifiers: list[Any] = []
        workers: list[threading.Thread] = []

        def worker() -> None:  # the round's pod: rank 1 of the announced world
            verifier = Verifier(refits.created[0]["manifest"])
            verifiers.append(verifier)
            group = Group("127.0.0.1", port, 1, 2, 60)
            try:
                for name, tensor in receive(group):
                    verifier.check(name, tensor)
                    got[name] = tensor.clone()
            finally:
                group.close()

        def join(number: int) -> None:
            workers.append(threading.Thread(target=worker, daemon=True))
            workers[-1].start()

        succeeded = {"phase": "Succeeded", "broadcast": {"round": 1, "state": "Done"}}
        refits = ScriptedRefits([ready(1, 2), succeeded], on_announce=join)
        client = RefitWeightSyncClient(refits, fleet_selector="app=rollout", timeout=60)
        engine = WeightTransferTrainerFactory.trainer_init(
            GlooTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=port,
                                timeout_seconds=60),
            client=client, source=ModuleSource(model),
        )  # fmt: skip
        try:
            client.prepare("B-gpu", reference)
            engine.send_weights()
        finally:
            engine.shutdown()
        for w in workers:
            w.join(60)
        want = {n: t.detach().cpu() for n, t in model.state_dict().items()}
        equal = bool(got) and all(torch.equal(got[n], want[n]) for n in got)
        problems = verifiers[0].problems if verifiers else ["no worker joined"]
        announced = [e for e in refits.log if e[0] == "announce"]
        report.check(
            "gloo-from-device",
            equal and not problems and len(got) == len(refits.created[0]["manifest"].tensors)
            and announced == [("announce", "refit-b-gpu", 1)]
            and client.last_status == succeeded,
            f"{len(got)} tensors from {device}, equal to the model's: {equal}, "
            f"promise problems: {problems or 'none'}, announced: {announced}",
        )  # fmt: skip
    except Exception:
        traceback.print_exc()
        report.add("gloo-from-device", "FAIL", "the check crashed (traceback above)")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
