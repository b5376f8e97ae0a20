"""The training run: its configuration, start-up checks and iteration loop (`loop.py`), the one-run-per-workdir
lock (`run_lock.py`) and signal handling (`interrupts.py`).
"""
