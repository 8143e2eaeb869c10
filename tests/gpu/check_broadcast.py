"""GPU check of broadcast refits: the refit-gloo engine feeding a CUDA vLLM server.

Run on a machine with an NVIDIA GPU and vLLM with CUDA, from the repository root with the
test venv (pytest, httpx, transformers: the tiny model is built locally, nothing is
downloaded):

    PYTHONPATH=worker_image:. python tests/gpu/check_broadcast.py

One vLLM server on the GPU (the tiny Llama, fp32, started from checkpoint A's files with
``--weight-transfer-config '{"backend": "refit-gloo"}'``); this process is the trainer, rank
0 of a world of 2, sending over gloo/TCP on loopback. The round arrives in host memory, is
checked against the promise and loaded by vLLM's layerwise reload into the GPU parameters.
Checks, printed as PASS / FAIL / SKIP / INFO like check_flashinfer_fp8_reload.py:

  starts-from-a          the probe against A's reference passes before any refit
  broadcast-loads        after a broadcast of B, refit_received reports B's promise and the
                         probe against B's reference passes
  broadcast-matches-file vLLM's /weight_checker checksums after the broadcast equal those
                         after a file refit of B (same processed GPU parameters)
  corrupted-refused      a round whose tensor differs from its promise is refused with
                         TransferMismatch and the GPU parameters are untouched
  nccl-by-name           vLLM's own ``nccl`` engine is registered under that name in
                         WeightTransferEngineFactory: the GPU image enables it with the
                         same flag (--weight-transfer-config '{"backend": "nccl"}'); INFO,
                         since a one-GPU machine cannot run an NCCL world of two ranks

Exit status: 0 when nothing FAILED, 1 when a check FAILED, 2 when the environment cannot
run the check. Not a pytest module; CI never runs it (no GPU there).
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

CORRUPTED = "model.layers.0.mlp.down_proj.weight"


def main() -> int:
    try:
        import torch

        if not torch.cuda.is_available():
            print("[SKIP] environment: no CUDA device", flush=True)
            return 2
        import httpx
        from refit_worker import broadcast
        from refit_worker.contract import TRANSFER_BACKEND, parse_rejection

        from testbed.tiny_model import ensure_tiny_model
        from testbed.vllm_server import start_vllm_server
        from tests.fixtures.broadcast import (
            checksums,
            connect,
            refit_by_broadcast,
            send_round,
            verdict,
        )
        from tests.fixtures.reload import refit_cycle
        from tests.gpu.check_flashinfer_fp8_reload import Report
    except ImportError as e:
        print(f"[SKIP] environment: {e}", flush=True)
        return 2

    report = Report()
    tiny = ensure_tiny_model()
    tensors = {k: broadcast.load_tensors(tiny.checkpoints[k]) for k in ("A", "B")}
    config = json.dumps({"backend": TRANSFER_BACKEND})
    try:
        with (
            start_vllm_server(
                tiny, load_format="safetensors", model_dir=tiny.checkpoints["A"],
                extra_args=["--weight-transfer-config", config],
            ) as server,
            httpx.Client(timeout=120) as http,
        ):  # fmt: skip
            sender = connect(server)
            ref_a, ref_b = tiny.reference("A"), tiny.reference("B")
            got, message = verdict(server, http, ref_a)
            report.check("starts-from-a", got == "Pass", message)

            received = refit_by_broadcast(server, http, sender, tensors["B"], "B-bcast")
            got, message = verdict(server, http, ref_b)
            report.check(
                "broadcast-loads",
                got == "Pass" and received["tensors"] == len(tensors["B"]),
                f"{message}; {received['tensors']} tensors, {received['bytes']} bytes, "
                f"receive {received['receiveSeconds']:.3f}s, load {received['loadSeconds']:.3f}s",
            )
            by_broadcast = checksums(server, http)
            refit_cycle(server, http, str(tiny.checkpoints["A"]), "A-file")
            refit_cycle(server, http, str(tiny.checkpoints["B"]), "B-file")
            by_file = checksums(server, http)
            differ = sorted(k for k in by_file if by_file[k] != by_broadcast.get(k))
            report.check(
                "broadcast-matches-file", not differ and bool(by_file),
                f"{len(by_file)} parameters" + (f"; differ: {differ[:5]}" if differ else ""),
            )  # fmt: skip

            sent: dict[str, Any] = {k: v.clone() for k, v in tensors["A"].items()}
            promise = broadcast.build_manifest(sent).to_json_dict()
            sent[CORRUPTED].add_(1.0)
            answer, _ = send_round(server, sender, promise, sent)
            code = (parse_rejection(answer.text) or ("", ""))[0]
            untouched = checksums(server, http) == by_file
            report.check(
                "corrupted-refused",
                answer.status_code == 500 and code == "TransferMismatch" and untouched,
                f"HTTP {answer.status_code}, code {code or '-'}, parameters untouched: {untouched}",
            )
            sender.close()
    except Exception:  # a crash is a failed check, with its traceback
        traceback.print_exc()
        report.add("broadcast", "FAIL", "the check crashed (traceback above)")

    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        names = sorted(getattr(WeightTransferEngineFactory, "_registry", {}) or {})
        report.add("nccl-by-name", "INFO", f"registered engines: {names}")
    except ImportError as e:
        report.add("nccl-by-name", "INFO", f"cannot read vLLM's engine registry: {e}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
