"""`python -m nlac_jax.evaluate`: evaluate a checkpoint or a plain HF model directory on a task. The command's code,
flags and exit codes: `nlac_jax/cli/evaluate.py`.
"""

if __name__ == "__main__":
    from nlac_jax.cli import common, evaluate
    common.run_command(evaluate)
