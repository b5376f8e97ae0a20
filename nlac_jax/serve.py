"""`python -m nlac_jax.serve`: serve a model as an OpenAI-compatible judge endpoint. The command's code, flags and exit
codes: `nlac_jax/cli/serve.py`.
"""

if __name__ == "__main__":
    from nlac_jax.cli import common, serve
    common.run_command(serve)
