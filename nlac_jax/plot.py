"""`python -m nlac_jax.plot`: draw a run's learning curves from its metrics.jsonl. The command's code, flags and exit
codes: `nlac_jax/cli/plot.py`.
"""

if __name__ == "__main__":
    from nlac_jax.cli import common, plot
    common.run_command(plot)
