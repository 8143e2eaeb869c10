"""The trainer side's Kubernetes configuration: an API client from the pod's service account
in-cluster, else from a kubeconfig, and the namespace a refit goes to when none is named."""

from __future__ import annotations

from pathlib import Path

from kubernetes import client as k8s
from kubernetes import config as k8s_config

from .refit_error import RefitError


def load_api_client(kubeconfig: str | Path | None, context: str | None) -> k8s.ApiClient:
    """The in-cluster configuration unless a kubeconfig or context is named, else the
    kubeconfig's (KUBECONFIG, ~/.kube/config)."""
    if kubeconfig is None and context is None:
        try:
            k8s_config.load_incluster_config()
            return k8s.ApiClient()
        except k8s_config.ConfigException:
            pass
    try:
        return k8s_config.new_client_from_config(
            config_file=str(kubeconfig) if kubeconfig else None, context=context
        )
    except (k8s_config.ConfigException, OSError) as e:
        raise RefitError(f"no usable Kubernetes configuration: {e}") from e


def default_namespace(kubeconfig: str | Path | None, context: str | None) -> str:
    """The kubeconfig context's namespace, the pod's own namespace in-cluster, else default."""
    sa_ns = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    try:
        _, current = k8s_config.list_kube_config_contexts(
            config_file=str(kubeconfig) if kubeconfig else None
        )
        if context:
            contexts, _ = k8s_config.list_kube_config_contexts(
                config_file=str(kubeconfig) if kubeconfig else None
            )
            current = next((c for c in contexts if c["name"] == context), current)
        ns = (current or {}).get("context", {}).get("namespace")
        if ns:
            return str(ns)
    except (k8s_config.ConfigException, OSError, TypeError):
        if sa_ns.is_file():
            return sa_ns.read_text().strip()
    return "default"
