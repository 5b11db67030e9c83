"""The layout planner: profile the model on the devices at hand (profiler.py, cached by profile.py), predict each
layout's TTFT, ITL and goodput for a workload and an SLO with a discrete-event simulation over the profile
(simulate.py, predict.py), and move workers between roles at run time from the router's metrics (rebalance.py).
docs/planner.md says what each figure means and how far to trust it."""
