"""`python -m nlac_jax.plan`: compile a run for a TPU topology on this CPU and say whether it fits. The command's code,
flags and exit codes: `nlac_jax/cli/plan.py`.
"""

if __name__ == "__main__":
    from nlac_jax.cli import common, plan
    common.run_command(plan)
