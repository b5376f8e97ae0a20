"""Planning a run before it runs: per-chip footprint and roofline estimates (`footprint.py`), Cloud TPU slice
specs (`tpu_specs.py`), and the planner's ahead-of-time compiles and fit check (`planner.py`; CLI: `cli/plan.py`).
"""
