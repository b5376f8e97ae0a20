"""Every command (`python -m nlac_jax.<name>` runs `cli/<name>.py`'s `main`) and the helpers they share.

`common.py`: exit codes, one-line errors, argument types; `setup.py`: gin loading and its checks, logging, the
compilation cache, workdir checks; `configurables.py`: the imports that register every gin configurable.
Nothing outside `cli/` imports from here except `experiments/` entry points (`unit_scale.main`).
The commands import jax and the library inside their functions, after the flags are parsed: `--help` and a bad flag
answer in a fraction of a second, and `distributed.initialize` runs before anything touches the devices.
"""
