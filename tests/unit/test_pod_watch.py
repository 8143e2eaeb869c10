"""The watch-fed pods of a namespace (edges/pod_watch.py), without a server: a selector
string selects what the API server's LIST would, and an older answer never replaces a newer
one (our own write's answer arrives before the watch's event of it, and a deleted pod's
DELETED event after a new pod of its name)."""

from __future__ import annotations

import asyncio
from typing import Any

from refit_operator.core.api_spec import LabelSelector
from refit_operator.edges.pod_watch import PodWatch, selector_matcher


def test_a_canonical_selector_selects_what_the_label_selector_matches() -> None:
    selector = LabelSelector.model_validate(
        {
            "matchLabels": {"app": "r"},
            "matchExpressions": [
                {"key": "tier", "operator": "In", "values": ["a", "b"]},
                {"key": "zone", "operator": "NotIn", "values": ["z"]},
                {"key": "gpu", "operator": "Exists"},
                {"key": "draining", "operator": "DoesNotExist"},
            ],
        }
    )
    match = selector_matcher(selector.canonical())
    for labels in (
        {"app": "r", "tier": "a", "gpu": "1"},
        {"app": "r", "tier": "b", "gpu": "1", "zone": "y"},
        {"app": "r", "tier": "c", "gpu": "1"},
        {"app": "r", "tier": "a", "gpu": "1", "zone": "z"},
        {"app": "r", "tier": "a"},
        {"app": "r", "tier": "a", "gpu": "1", "draining": "yes"},
        {"app": "x", "tier": "a", "gpu": "1"},
    ):
        assert match(labels) == selector.matches(labels), labels
    assert selector_matcher("")({"any": "thing"})


def _pod(name: str, rv: int, uid: str = "u1", **labels: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "uid": uid, "resourceVersion": str(rv), "labels": labels},
        "spec": {},
        "status": {"podIP": "127.0.0.2"},
    }


def test_an_older_answer_never_replaces_a_newer_one() -> None:
    async def main() -> None:
        w = PodWatch(lambda: None, "ns")
        w.synced.set()
        w.task = asyncio.get_running_loop().create_future()  # type: ignore[assignment]
        w.put(_pod("b", 5, app="r"))
        w.put(_pod("a", 7, app="r"))
        w.put(_pod("a", 6, app="x"))  # the watch's event of a write we already hold
        listed = await w.pods("app=r")
        assert [(p.name, p.labels["app"]) for p in listed] == [("a", "r"), ("b", "r")]
        w.put(_pod("b", 9, uid="u2", app="r"))  # b deleted and created again; then its DELETED
        w._drop(_pod("b", 8))
        assert [(p.name, p.uid) for p in await w.pods("")] == [("a", "u1"), ("b", "u2")]
        w._drop(_pod("a", 10))
        assert [p.name for p in await w.pods("app=r")] == ["b"]

    asyncio.run(main())
