"""Every command (`python -m nlac_jax.<name>` runs `cli/<name>.py`'s `main`) and the helpers they share.

`common.py`: exit codes, one-line errors, argument types; `setup.py`: gin loading and its checks, logging, the
compilation cache, workdir checks; `configurables.py`: the imports that register every gin configurable.
Nothing outside `cli/` imports from here except `experiments/` entry points (`unit_scale.main`).
"""
