"""`python -m nlac_jax.generate`: sample completions from a model directory. The command's code, flags and exit codes:
`nlac_jax/cli/generate.py`.
"""

if __name__ == "__main__":
    from nlac_jax.cli import common, generate
    common.run_command(generate)
