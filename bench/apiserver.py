"""API-server request counts from the server's own `apiserver_request_total` metric."""

from __future__ import annotations

from collections import Counter

from prometheus_client.parser import text_string_to_metric_families

from testbed.controlplane import ControlPlane

WRITE_VERBS = frozenset({"POST", "PUT", "PATCH", "DELETE", "APPLY"})
Key = tuple[str, str]  # (verb, resource[/subresource])


def parse_request_totals(text: str) -> Counter[Key]:
    """Requests per (verb, resource[/subresource]); non-resource paths (/metrics, /readyz,
    discovery) are left out: they are not the operator's work."""
    out: Counter[Key] = Counter()
    for family in text_string_to_metric_families(text):
        if family.name != "apiserver_request":  # the parser strips the _total suffix
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            labels = sample.labels
            resource = labels.get("resource", "")
            if not resource:
                continue
            if labels.get("subresource"):
                resource = f"{resource}/{labels['subresource']}"
            out[(labels.get("verb", "?"), resource)] += int(sample.value)
    return out


def request_totals(cp: ControlPlane) -> Counter[Key]:
    return parse_request_totals(cp.kubectl("get", "--raw", "/metrics").stdout)


def diff(after: Counter[Key], before: Counter[Key]) -> Counter[Key]:
    out = Counter({k: after[k] - before.get(k, 0) for k in after})
    return +out  # drop zero and negative entries


def by_verb(counts: Counter[Key]) -> dict[str, int]:
    verbs: Counter[str] = Counter()
    for (verb, _), n in counts.items():
        verbs[verb] += n
    return dict(sorted(verbs.items()))


def writes(counts: Counter[Key]) -> int:
    return sum(n for (verb, _), n in counts.items() if verb in WRITE_VERBS)
