"""`make demo` (`python -m demo`): Refit's main job end to end on real parts, built from the
test bed (testbed/). Runs from a checkout; not part of the installed package."""
