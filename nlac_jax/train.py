"""`python -m nlac_jax.train`: train (or resume) the gin-configured NLAC run. The command's code, flags and exit codes:
`nlac_jax/cli/train.py`.
"""

if __name__ == "__main__":
    from nlac_jax.cli import common, train
    common.run_command(train)
