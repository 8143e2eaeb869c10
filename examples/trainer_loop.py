"""A training loop that refits its rollout fleet after every update, with the trainer-side
SDK's RefitClient (refit_client).

    python examples/trainer_loop.py --model-dir /ckpt/base --out-root /ckpt/run1 \\
        --pod-root /checkpoints/run1 --selector app=rollout --namespace rl --probe-texts texts.txt

Each iteration: train a few steps, save a checkpoint (safetensors), write its manifest and
probe reference, submit a WeightRefit and wait for the fleet's verdict. With
`--broadcast HOST:PORT` no checkpoint is written: the weights go from this process's memory to
every pod over the network (docs/broadcast.md), with the probe reference computed from the
model in memory; the pods must run with `--weight-transfer-config '{"backend": "refit-gloo"}'`
and reach HOST:PORT. The fleet serves the
new weights only when every pod's probe passed; on failure the operator rolled the fleet
back (onFailure: Rollback) and the loop stops with the operator's reason.

The training itself is a stand-in (next-token loss on the probe texts); replace `train_steps`
with your algorithm. Needs torch and transformers (the trainer's own environment).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from refit_client import RefitClient, RefitFailed, RefitTimeout

log = logging.getLogger("trainer")


def train_steps(model, tokenizer, texts: list[str], steps: int, lr: float) -> float:  # type: ignore[no-untyped-def]
    """Stand-in for the RL update: a few language-model steps on the texts."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        batch = tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=64)
        loss = model(**batch, labels=batch["input_ids"]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, required=True, help="HF model to start from")
    p.add_argument("--out-root", type=Path, help="where checkpoints are written")
    p.add_argument(
        "--broadcast",
        metavar="HOST:PORT",
        default=None,
        help="send the weights from memory instead (the pods reach HOST:PORT)",
    )
    p.add_argument("--pod-root", default=None, help="out-root as mounted in the pods")
    p.add_argument("--selector", default="app=rollout", help="the fleet's labels")
    p.add_argument("--namespace", default=None)
    p.add_argument("--kubeconfig", default=None)
    p.add_argument("--probe-texts", type=Path, required=True, help="one probe text per line")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--steps-per-iteration", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--refit-timeout", type=float, default=900)
    args = p.parse_args(argv)
    if (args.out_root is None) == (args.broadcast is None):
        p.error("give exactly one of --out-root (checkpoints) and --broadcast HOST:PORT")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from refit_worker import broadcast as wire
    from refit_worker import reference
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model_dir)
    texts = [t for t in args.probe_texts.read_text().splitlines() if t.strip()]
    probe_ids = reference.tokenize(args.model_dir, texts, 128)
    refits = RefitClient(namespace=args.namespace, kubeconfig=args.kubeconfig)

    def progress(st: dict, name: str = "") -> None:
        log.info("  %s: %s %s/%s", name, st.get("phase"), st.get("updatedPods", 0),
                 st.get("targetPods", 0))  # fmt: skip

    for it in range(1, args.iterations + 1):
        loss = train_steps(model, tokenizer, texts, args.steps_per_iteration, args.lr)
        version = f"iter-{it}"
        if args.broadcast:
            host, _, port = args.broadcast.rpartition(":")
            try:
                status = refits.broadcast(
                    wire.model_tensors(model), version, fleet_selector=args.selector,
                    rendezvous=(host, int(port)),
                    reference=reference.reference_from_model(
                        model, probe_ids, version=version, tool="examples/trainer_loop.py"
                    ),
                    timeout=args.refit_timeout, strategy="AllAtOnce", on_failure="Rollback",
                    on_update=lambda st, v=version: progress(st, v),
                )  # fmt: skip
            except (RefitFailed, RefitTimeout) as e:
                log.error("broadcast of %s did not succeed: %s", version, e)
                return 1
            log.info("iteration %d: loss %.4f; fleet serves %s (sent from memory)",
                     it, loss, version)  # fmt: skip
            continue
        ckpt = args.out_root / version
        model.save_pretrained(ckpt, safe_serialization=True)
        tokenizer.save_pretrained(ckpt)
        name = refits.submit(
            ckpt,
            version,
            fleet_selector=args.selector,
            pod_path=f"{args.pod_root}/{version}" if args.pod_root else None,
            write_manifest=True,  # after every shard is written: the pods verify against it
            write_reference_texts=texts,
            strategy="AllAtOnce",  # the RL barrier: the whole fleet switches between steps
            on_failure="Rollback",
        )
        log.info("iteration %d: loss %.4f, submitted %s", it, loss, name)
        try:
            status = refits.wait(
                name,
                args.refit_timeout,
                on_update=lambda st, name=name: log.info(
                    "  %s: %s %s/%s", name, st.get("phase"), st.get("updatedPods", 0),
                    st.get("targetPods", 0),
                ),
            )  # fmt: skip
        except RefitFailed as e:
            log.error("refit %s ended %s: %s: %s", name, e.phase, e.reason, e.message)
            for f in e.pod_failures:
                log.error("  %s: %s %s", f.pod, f.reason, f.message)
            return 1
        except RefitTimeout as e:
            log.error("%s", e)
            return 1
        worst = status.get("probeSummary", {}).get("worstMaxAbsLogprobDiff", 0.0)
        log.info("fleet serves %s (worst |Δlogprob| %.2e)", version, worst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
