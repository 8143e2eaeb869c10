"""Refit's trainer-side SDK: what a trainer, an operator of the fleet or a notebook imports.

    from refit_client import RefitClient, RefitFailed

    refits = RefitClient()                         # in-cluster config, else KUBECONFIG
    name = refits.submit("/ckpt/step-100", "step-100", fleet_selector={"app": "rollout"})
    refits.wait(name, timeout=600)

- client: RefitClient (submit a WeightRefit, broadcast from memory, wait for the verdict);
  refit_document builds the WeightRefit it submits, checkpoint_files writes the manifest and
  probe reference into a checkpoint, kubeconfig finds the cluster, refit_error's RefitError is
  the one class a trainer catches;
- kubectl_plugin: `kubectl refit` (the kubectl-refit console script), kubectl_text what it
  prints;
- report: the PNG of one refit; grpo_report: the PNG of a training run through Refit (the
  `report` extra, matplotlib);
- integrations: training frameworks driven through the client (integrations.trl, the `trl`
  extra).

Importing the SDK loads neither kopf nor the operator's controller or I/O edges: it reads the
operator's pure core (refit_operator.core: the API models, the pod records, the gate) and the
wire contract (refit_worker.contract), and torch only where a call sends tensors.
"""

from __future__ import annotations

from .client import PodFailure, RefitClient, RefitFailed, RefitTimeout
from .refit_error import RefitError

__all__ = ["PodFailure", "RefitClient", "RefitError", "RefitFailed", "RefitTimeout"]
