"""What a run reports: the metrics.jsonl writer and summary table (`metrics.py`), the plots (`plots.py`).
"""
