"""Where files live: the ONE filesystem layer for local paths and `gs://` (`fs.py`). Every file a run reads or
writes goes through it.
"""
