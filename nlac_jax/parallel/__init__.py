"""Parallelism and compilation: the mesh and the ONE logical-axis rules table (`sharding.py`), several processes
(`distributed.py`), the XLA options per executable kind (`xla_options.py`), compilation counting (`compilations.py`).
"""
