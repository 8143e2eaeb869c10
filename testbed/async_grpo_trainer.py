"""A real asynchronous GRPO run through Refit: TRL's experimental ``AsyncGRPOTrainer`` on the
tiny model (fp32, CPU), its weights published at every optimizer step by
``refit_client.integrations.trl_async.RefitWeightTransfer`` (one broadcast WeightRefit per sync,
Rolling one pod at a time with drainMode keep) while ``RefitRolloutWorker`` keeps generating on
the fleet, each sample tagged with the versions the pods served it with and trained on only
within ``--max-staleness``. The reward is testbed.grpo_trainer's: the count of " red".

What is not the product's, on CPU only (``cpu_shims``): TRL's tree attention gets
testbed.cpu_tree_attention instead of the Hub's FlashAttention-3 kernels, and TRL's MFU metric
gets no peak FLOPs instead of asking CUDA for the device's name
(trl/trainer/utils.py ``get_peak_flops_per_device``: ``torch.cuda.get_device_name``).

Writes one JSON document: the syncs (version, refit, when, phase, reason), what the trainer
consumed per version and dropped (RefitRolloutWorker.report), every completion's finish time,
unit, served versions and tokens, the losses and rewards TRL logged per step, and how training
ended; with ``--steady-seconds`` also the fleet's steady state after training (``steady``).

    python -m testbed.async_grpo_trainer --kubeconfig K --namespace NS --fleet-port 8000 \\
        --port 29600 --model-dir CKPT --probe-texts texts.txt --out run.json \\
        [--steps 8] [--prefix async] [--max-staleness 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from refit_client.client import RefitClient
from refit_client.integrations.trl_async import RefitRolloutWorker, RefitWeightTransfer

from testbed.grpo_trainer import PROMPTS, WORD, train_to_end, trainer_arguments


def reward_red(completions: Sequence[str], **_: Any) -> list[float]:
    """Module-level, as TRL's reward functions must be."""
    return [float(c.count(WORD)) for c in completions]


def cpu_shims() -> list[str]:
    """What this CPU run replaces in TRL, where there is no CUDA device (the module's
    docstring); the names of what it replaced."""
    import torch

    if torch.cuda.is_available():
        return []
    from trl.experimental.async_grpo import async_grpo_trainer

    from testbed import cpu_tree_attention

    cpu_tree_attention.install()
    async_grpo_trainer.get_peak_flops_per_device = lambda *_a, **_k: None
    return ["packing._flash_attn", "get_peak_flops_per_device"]


def steady(worker: RefitRolloutWorker, seconds: float) -> dict[str, Any]:
    """The fleet's steady state for the same client: ``worker`` (shaped as the run's) generates
    for ``seconds`` with the trainer idle and no refit; its window and completions."""
    began = time.monotonic()
    worker.start()
    time.sleep(seconds)
    ended = time.monotonic()
    worker.stop()
    return {"began": began, "ended": ended, "finished": [list(f) for f in worker.finished]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    trainer_arguments(p)
    p.add_argument("--prefix", default="async", help="versions are PREFIX-vN")
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--spec", default="{}", help="more spec fields, as client keywords (JSON)")
    p.add_argument("--steady-seconds", type=float, default=0.0,
                   help="after training: generate this long, no refit, no training")  # fmt: skip
    args = p.parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    shims = cpu_shims()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    texts = [t for t in args.probe_texts.read_text().splitlines() if t.strip()]
    probe_ids = [tok(t)["input_ids"][:32] for t in texts[:4]]
    steps: dict[int, dict[str, Any]] = {}
    out: dict[str, Any] = {"steps": steps, "shims": shims}

    class Log(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            logs = kw.get("logs") or {}
            if "loss" in logs:
                steps[int(state.global_step)] = {
                    k: logs.get(k) for k in ("loss", "reward", "kl", "ratio")
                } | {"at": time.monotonic()}

    with RefitClient(namespace=args.namespace, kubeconfig=args.kubeconfig) as client:
        transfer = RefitWeightTransfer(
            client, fleet_selector=args.selector, port=args.fleet_port,
            probe_token_ids=probe_ids, rendezvous=(args.host, args.port),
            version_prefix=args.prefix, refit_timeout=240, spec=json.loads(args.spec),
            keep_versions=args.max_staleness + 2,  # every version a sample may be trained from
        )  # fmt: skip

        def new_worker() -> RefitRolloutWorker:
            return RefitRolloutWorker(
                client, fleet_selector=args.selector, port=args.fleet_port, prompts=PROMPTS,
                reward_funcs=[reward_red], tokenizer=tok, num_generations=8, max_tokens=12,
                max_staleness=args.max_staleness, version_prefix=args.prefix, concurrency=2,
                request_timeout=120, queue_maxsize=32,  # two steps' worth, the freshest kept
                model_at=transfer.model_at,
            )  # fmt: skip

        worker = new_worker()
        config = AsyncGRPOConfig(
            output_dir=tempfile.mkdtemp(prefix="async-grpo-"), use_cpu=True, bf16=False,
            dtype="float32", per_device_train_batch_size=16, num_generations=8,
            max_completion_length=12, temperature=1.0, learning_rate=args.lr,
            lr_scheduler_type="constant", max_steps=args.steps, logging_steps=1,
            save_strategy="no", report_to=[], seed=0, token_budget=0,
            max_staleness=args.max_staleness, weight_sync_steps=1,
            heartbeat_stale_after_s=240,
        )  # fmt: skip
        trainer = AsyncGRPOTrainer(
            model=str(args.model_dir), reward_funcs=[reward_red], args=config,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok,
            rollout_worker=worker, weight_transfer=transfer, callbacks=[Log()],
        )  # fmt: skip
        transfer.model = trainer.model
        try:
            out["end"] = train_to_end(trainer)
        finally:
            worker.stop()
        out["syncs"] = [asdict(s) for s in transfer.syncs]
        out["consumption"] = worker.report()
        out["finished"] = [list(f) for f in worker.finished]
        if args.steady_seconds > 0 and out["end"] == {"phase": "Succeeded"}:
            out["steady"] = steady(new_worker(), args.steady_seconds)
    out["losses_finite"] = all(math.isfinite(s.get("loss") or 0.0) for s in steps.values())
    args.out.write_text(json.dumps(out, indent=1, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
