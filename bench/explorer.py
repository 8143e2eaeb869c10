"""The fault explorer's long mode (testbed/explorer): thousands of seeded schedules of every
holding fault class against the operator's real Engine, in-process, on virtual time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.results import Metric
from testbed.explorer.holes import FEATURES, HOLDING, KNOWN_HOLES, SOURCES, run_batch

SHORT = 5000  # schedules of 20 steps over 2 pods, classes mixed by seed (--quick: 200)
FULL = 500  # schedules of 40 steps over 3 pods (--quick: 20)
# Schedules of 40 steps over 3 pods mixing issue 41's classes (adapters, pod groups) with the
# holding ones (--quick: 20); their known holes are tolerated by signature.
FEATURE_SCHEDULES = 500
# Schedules of 40 steps over 3 pods with every weight-source class of holes.SOURCES on (a
# drafter refitted with its target, stale in some refits; broadcast refits whose trainer is
# late, dies or sends wrong bytes) among the holding ones (--quick: 20).
SOURCE_SCHEDULES = 300


def suite(
    quick: bool, log: Callable[[str], None]
) -> tuple[list[Metric], dict[str, Any], list[str]]:
    short = run_batch(range(100_000, 100_000 + (200 if quick else SHORT)))
    log(f"explorer short: {short.summary()}")
    full = run_batch(range(200_000, 200_000 + (20 if quick else FULL)), steps=40, pods=3)
    log(f"explorer full: {full.summary()}")
    features = run_batch(
        range(300_000, 300_000 + (20 if quick else FEATURE_SCHEDULES)),
        steps=40, pods=3, pool=FEATURES + HOLDING,
    )  # fmt: skip
    log(f"explorer features: {features.summary()}")
    sources = run_batch(
        range(400_000, 400_000 + (20 if quick else SOURCE_SCHEDULES)),
        steps=40, pods=3, always=frozenset(SOURCES),
    )  # fmt: skip
    log(f"explorer sources: {sources.summary()}")
    batches = (("20 steps, 2 pods", short), ("40 steps, 3 pods", full),
               ("features, 40 steps, 3 pods", features),
               ("sources, 40 steps, 3 pods", sources))  # fmt: skip
    metrics = []
    for label, b in batches:
        metrics += [
            Metric(f"schedules per second ({label})", [b.per_second], "1/s"),
            Metric(f"schedules ({label})", [b.schedules], "schedules"),
            Metric(f"steps explored ({label})", [b.steps], "steps"),
            Metric(f"invariant checks ({label})", [b.checks], "checks"),
            Metric(f"virtual time ({label})", [round(b.virtual_seconds)], "s"),
            Metric(f"violations ({label})", [len(b.failures)], "schedules", target="<= 0"),
        ]
    raw = {
        label: {
            "schedules": b.schedules,
            "steps": b.steps,
            "checks": b.checks,
            "seconds": round(b.seconds, 1),
            "virtual_seconds": round(b.virtual_seconds),
            "tolerated": dict(b.tolerated),
            "failed": [
                {
                    "seed": r.config.seed,
                    "replay": r.replay(),
                    "violations": [str(v) for v in r.violations],
                }
                for r in b.failures
            ],
        }
        for label, b in (
            ("short", short),
            ("full", full),
            ("features", features),
            ("sources", sources),
        )
    }
    notes = [
        f"classes: {', '.join(HOLDING)}; switched off by known holes: "
        f"{', '.join(n for n, h in KNOWN_HOLES.items() if h.excludes)}; the features "
        f"batch mixes in {', '.join(FEATURES)}; the sources batch has {', '.join(SOURCES)} "
        "on in every schedule",
        "Violations are schedules whose violations no known hole's signature explains; "
        "each failure's replay command is in the raw result.",
        "One process on a shared 2-core machine; rates are wall-clock.",
    ]
    return metrics, raw, notes
