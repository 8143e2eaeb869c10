"""A trainer process for broadcast refits: sends a checkpoint's tensors to the fleet through
`refit_client.client.RefitClient.broadcast`, optionally with one fault injected, and
prints the verdict as one JSON line. Tests run it as a real process (it may die mid-send).

    python -m testbed.broadcast_trainer --kubeconfig K --namespace NS --name N --version V \\
        --tensors CKPT_DIR --reference refit-probe.json --port P --fleet-port 8000 \\
        [--fault die-mid-send|stall-after-header|slow-send|extra-rank|corrupt-after-promise|silent]
        [--spec JSON]

Faults (each changes only this process):
- die-mid-send: the process exits (status 9) after the round's header, before any tensor.
- slow-send: announces the round, then waits longer than the transfer timeout before sending.
- extra-rank: opens the rendezvous for one rank more than the operator assigned (a rank that
  never joins).
- corrupt-after-promise: changes one tensor after its digest went into the promise.
- silent: never opens the rendezvous nor announces a round (it still waits for the verdict).
- stall-after-header: sends the round's header, then waits STALL_SECONDS before the tensors
  (the pods are inside their receive meanwhile: a test kills one of them there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from refit_client.client import RefitClient, RefitFailed
from refit_client.refit_error import RefitError
from refit_worker import broadcast as wire

CORRUPTED = "model.layers.0.mlp.down_proj.weight"
STALL_SECONDS = 8.0


def inject(fault: str, tensors: dict[str, Any], transfer_timeout: int) -> None:
    if fault in ("die-mid-send", "stall-after-header"):
        broadcasts = [0]
        original = wire.Group.broadcast

        def broadcast(self: wire.Group, tensor: Any) -> None:
            broadcasts[0] += 1
            if self.rank == 0 and broadcasts[0] == 3:  # wire version, header, then a bucket
                if fault == "die-mid-send":
                    os._exit(9)
                time.sleep(STALL_SECONDS)
            original(self, tensor)

        wire.Group.broadcast = broadcast  # type: ignore[method-assign]
    elif fault == "slow-send":
        send = wire.Sender.send

        def slow(self: wire.Sender, items: Any) -> Any:
            time.sleep(transfer_timeout + 5)
            return send(self, items)

        wire.Sender.send = slow  # type: ignore[method-assign,assignment]
    elif fault == "extra-rank":
        init = wire.Sender.__init__

        def wider(self: wire.Sender, world_size: int, **kwargs: Any) -> None:
            init(self, world_size + 1, **kwargs)

        wire.Sender.__init__ = wider  # type: ignore[method-assign]
    elif fault == "corrupt-after-promise":
        build = wire.build_manifest

        def promise_then_corrupt(items: Any) -> Any:
            manifest = build(items)
            tensors[CORRUPTED].add_(1.0)  # the bytes sent are no longer the ones promised
            return manifest

        wire.build_manifest = promise_then_corrupt  # type: ignore[assignment]
    elif fault == "silent":

        def refuse(self: wire.Sender, *args: Any, **kwargs: Any) -> None:
            raise OSError("fault injected: this trainer never opens its rendezvous")

        wire.Sender.__init__ = refuse  # type: ignore[method-assign]
    elif fault != "none":
        raise SystemExit(f"unknown fault {fault!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--version", required=True)
    p.add_argument("--tensors", type=Path, required=True, help="checkpoint directory to send")
    p.add_argument("--reference", type=Path, required=True, help="refit-probe.json")
    p.add_argument("--drafter", type=Path, help="the draft_model drafter's checkpoint to send too")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--selector", default="app=rollout")
    p.add_argument("--fleet-port", type=int, required=True, help="the pods' vLLM port")
    p.add_argument("--transfer-timeout", type=int, default=60)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--fault", default="none")
    p.add_argument("--spec", default="{}", help="more spec fields, as client keywords (JSON)")
    args = p.parse_args(argv)

    tensors = wire.load_tensors(args.tensors)
    inject(args.fault, tensors, args.transfer_timeout)
    rounds: list[dict[str, Any]] = []
    out: dict[str, Any] = {"rounds": rounds}
    with RefitClient(namespace=args.namespace, kubeconfig=args.kubeconfig) as client:
        try:
            status = client.broadcast(
                tensors, args.version, fleet_selector=args.selector,
                rendezvous=(args.host, args.port), reference=args.reference,
                timeout=args.timeout, name=args.name, port=args.fleet_port,
                transfer_timeout_seconds=args.transfer_timeout,
                drafter=wire.load_tensors(args.drafter) if args.drafter else None,
                on_send=lambda n, stats: rounds.append({"round": n, **stats.to_json_dict()}),
                **json.loads(args.spec),
            )  # fmt: skip
            out.update(phase=status.get("phase"), status=status)
        except RefitFailed as e:
            out.update(phase=e.phase, reason=e.reason, message=e.message)
        except RefitError as e:
            out.update(phase="", error=str(e))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
