"""In-process test fixtures shipped with the package (tests and the demo; no downloads): tiny tokenizers, HF
directories and models (`tiny.py`).
"""
