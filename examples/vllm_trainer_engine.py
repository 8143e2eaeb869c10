"""vLLM's trainer-side weight transfer engine, with Refit's client: each ``send_weights()``
refits the whole fleet through the operator, probe-gated (docs/integrations.md, "vLLM's
trainer engines with Refit's client"; tests/e2e/test_broadcast_refit.py runs this file).

    python examples/vllm_trainer_engine.py --model-dir CKPT --version step-1 \\
        --reference CKPT/refit-probe.json --rendezvous 10.0.0.5:29500 --selector app=rollout

The pods run vLLM with ``--weight-transfer-config '{"backend": "refit-gloo"}'`` and reach the
rendezvous (docs/broadcast.md). ``--spec`` adds the refits' spec fields as RefitClient
keywords (JSON: port, admin_token_secret, strategy, ...). Needs vLLM, torch and transformers
in the trainer's environment.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from refit_client import RefitClient, RefitFailed, RefitTimeout
from refit_client.weight_sync import RefitWeightSyncClient
from refit_worker.broadcast.gloo_trainer import GlooTrainerInitInfo
from refit_worker.plugin import register_transfer_engines
from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory


def fleet_engine(refits: RefitClient, model: Any, rendezvous: tuple[str, int], **fleet: Any) -> Any:
    """vLLM's refit-gloo trainer engine for ``model``, sending to the fleet through Refit's
    client from ``rendezvous`` (host, port: where the pods reach this process); ``fleet``:
    RefitWeightSyncClient's keywords (fleet_selector, timeout, the refits' spec fields)."""
    host, port = rendezvous
    register_transfer_engines()  # refit-gloo in vLLM's trainer factory
    return WeightTransferTrainerFactory.trainer_init(
        GlooTrainerInitInfo(rank=0, master_address=host, master_port=port),
        client=RefitWeightSyncClient(refits, **fleet),
        source=ModuleSource(model),
    )


def refit(engine: Any, version: str, reference: Any) -> dict[str, Any]:
    """One send: the fleet serves ``version`` once every pod's probe against ``reference``
    passed; RefitFailed (the operator's reason) or RefitTimeout otherwise."""
    engine.client.prepare(version, reference)
    engine.send_weights()
    return dict(engine.client.last_status)


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM

    p = argparse.ArgumentParser(description="Refit the fleet once, by vLLM's trainer engine.")
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--version", required=True)
    p.add_argument("--reference", type=Path, required=True, help="refit-probe.json")
    p.add_argument("--rendezvous", required=True, metavar="HOST:PORT")
    p.add_argument("--selector", default="app=rollout")
    p.add_argument("--namespace")
    p.add_argument("--kubeconfig", type=Path)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--spec", type=json.loads, default={}, help="more spec fields (JSON)")
    args = p.parse_args(argv)
    host, port = args.rendezvous.rsplit(":", 1)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir)
    with RefitClient(namespace=args.namespace, kubeconfig=args.kubeconfig) as refits:
        engine = fleet_engine(refits, model, (host, int(port)), fleet_selector=args.selector,
                              timeout=args.timeout, **args.spec)  # fmt: skip
        try:
            status = refit(engine, args.version, args.reference)
        except (RefitFailed, RefitTimeout) as e:
            print(e, file=sys.stderr)
            return 1
        finally:
            engine.shutdown()
    print(f"{args.version}: {status['phase']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
