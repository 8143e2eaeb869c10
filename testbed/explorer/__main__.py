"""``python -m testbed.explorer --seed N [--classes a,b|all|holding|none] [--count K] [--trace]``:
run seeded schedules; a failing one prints its violations, its trace and how to replay it.
``holding``: every class not switched off by a known hole (testbed/explorer/holes.py)."""

from __future__ import annotations

import argparse
import sys
import time

from .explore import CLASSES, Config, run_schedule


def parse_classes(text: str) -> frozenset[str]:
    if text == "all":
        return frozenset(CLASSES)
    if text == "holding":
        from .holes import HOLDING

        return frozenset(HOLDING)
    if text in ("", "none"):
        return frozenset()
    return frozenset(c.strip() for c in text.split(",") if c.strip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.explorer", description=__doc__)
    ap.add_argument("--seed", type=int, default=0, help="first seed")
    ap.add_argument("--count", type=int, default=1, help="schedules, seeds seed..seed+count-1")
    ap.add_argument(
        "--classes", default="none", help=f"comma-separated, all, holding, none: {CLASSES}"
    )
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--pods", type=int, default=3)
    ap.add_argument("--trace", action="store_true", help="print every schedule's full trace")
    ap.add_argument(
        "--ignore", default="", help="invariants not held, comma-separated (to look past a hole)"
    )
    args = ap.parse_args(argv)
    classes = parse_classes(args.classes)
    ignore = frozenset(i.strip() for i in args.ignore.split(",") if i.strip())
    failed = steps = checks = 0
    began = time.perf_counter()
    for seed in range(args.seed, args.seed + args.count):
        result = run_schedule(
            Config(seed, classes, steps=args.steps, pods=args.pods, ignore=ignore)
        )
        steps += result.steps
        checks += result.checks
        if args.trace:
            print("\n".join(result.trace))
        if not result.ok:
            failed += 1
            print(result.report(tail=10**6 if args.trace else 80))
        elif args.count == 1:
            print(
                f"seed {seed}: ok, trace {result.digest}, {result.steps} steps, "
                f"{result.checks} checks, {result.virtual_seconds:.0f} virtual seconds"
            )
    wall = time.perf_counter() - began
    print(f"{args.count} schedules ({failed} failed), {steps} steps, {checks} invariant checks "
          f"in {wall:.1f}s: {args.count / wall:.1f} schedules/s", file=sys.stderr)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
