"""A deterministic fault explorer for the operator (docs/concepts.md, "Invariants and the
explorer"): explore.run_schedule runs one seeded schedule; ``python -m testbed.explorer``."""

from .explore import CLASSES, Config, Result, run_schedule

__all__ = ["CLASSES", "Config", "Result", "run_schedule"]
