"""Serve a model directory behind the OpenAI chat API (as vLLM does), for judges, oracles and users over HTTP.

    python -m nlac_jax.serve --model_dir DIR [--port 8000] [--host 127.0.0.1] [--name NAME] [--max_batch 32]
        [--dtype float32|bfloat16] [--tensor N] [--fsdp M]

Endpoints: ``GET /v1/models``, ``POST /v1/chat/completions`` (temperature, top_p, max_tokens, stop strings, n=1;
``usage`` and ``finish_reason`` 'stop' / 'length'); concurrent requests are batched into one sampler call
(nlac_jax/judges/server.py). The model name is the directory's name unless --name says otherwise. Point
``OpenAIChatModel.base_url`` at ``http://HOST:PORT/v1``.

A judge-sized model: ``--dtype bfloat16`` stores and computes in bfloat16 (norms, softmax and RoPE stay float32);
``--tensor N --fsdp M`` shards the weights over a (1, M, N) mesh of the first N x M devices (tensor: heads and MLP
columns, N must divide the attention heads; fsdp: the other weight axis and the batch), as training does; the
default 1 x 1 is one device. Its memory per chip, compiled for a TPU topology on any CPU: ``python -m nlac_jax.plan
--serve`` with the same flags (nlac_jax/plan.py). Up to
``--max_batch`` rows decode at once; a larger group of waiting requests is decoded by continuous batching.

Exit codes: 0 interrupted cleanly; 2 usage error (a bad flag, a missing model directory, a port in use); 1 any other
handled error; --debug shows the full traceback.
"""

from __future__ import annotations

import os

from nlac_jax.cli import common as cli

PROG = "python -m nlac_jax.serve"


def build_parser() -> cli.ArgumentParser:
    """The serve CLI's parser (values are range-checked here: a bad one is refused before the model loads)."""
    p = cli.ArgumentParser(prog=PROG, description=__doc__)
    p.add_argument("--model_dir", required=True, metavar="DIR",
                   help="HF model directory (config.json, weights, tokenizer)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=cli.int_at_least(0), default=8000, help="TCP port (default 8000; 0 = a free one)")
    p.add_argument("--name", default=None, help="served model name (default: the directory's name)")
    add_model_flags(p)
    p.add_argument("--batch_wait_ms", type=cli.finite_at_least(0.0), default=5.0,
                   help="how long the batcher waits for more requests after the first (default 5 ms)")
    p.add_argument("--max_body_mb", type=cli.finite_at_least(0.001), default=16.0,
                   help="largest request body accepted, in MiB; larger gets HTTP 413 (default 16)")
    p.add_argument("--default_max_tokens", type=cli.int_at_least(1), default=256,
                   help="max_tokens when a request sends none (default 256)")
    return p


def add_model_flags(p, defaults: bool = True) -> None:
    """--dtype, --tensor, --fsdp, --max_batch: what the server compiles and holds per chip. The planner
    (`python -m nlac_jax.plan --serve`) takes the same flags from here; defaults=False leaves an absent flag unset
    (argparse.SUPPRESS), so it can tell a serve flag that was given from one that was not."""
    import argparse
    d = (lambda v: v) if defaults else (lambda v: argparse.SUPPRESS)
    p.add_argument("--dtype", default=d("float32"), choices=("float32", "bfloat16"),
                   help="weights and compute dtype (default float32; bfloat16 for a 7B+ judge)")
    p.add_argument("--tensor", type=cli.int_at_least(1), default=d(1),
                   help="tensor-parallel devices of the mesh (default 1)")
    p.add_argument("--fsdp", type=cli.int_at_least(1), default=d(1),
                   help="fsdp devices of the mesh (default 1); the mesh takes the first tensor x fsdp devices")
    p.add_argument("--max_batch", type=cli.int_at_least(1), default=d(32),
                   help="rows decoded at once; more waiting requests are decoded by continuous batching "
                        "(default 32)")


def parse_flags(argv=None):
    """The serve CLI's flags."""
    return build_parser().parse_args(argv)


def main(argv=None) -> int:
    """Load the model and serve until interrupted."""
    flags = parse_flags(argv)
    from nlac_jax.cli import setup
    setup.setup_logging()
    cli.require_dir(flags.model_dir, "--model_dir")
    from nlac_jax import models
    from nlac_jax.judges.server import JudgeServer, check_tensor, config_overrides, make_mesh
    from nlac_jax.storage import fs
    name = flags.name or os.path.basename(os.path.normpath(flags.model_dir))
    overrides = config_overrides(flags.dtype)
    check_tensor(models.ModelConfig.from_hf_file(flags.model_dir, **overrides), flags.tensor,
                 fs.join(flags.model_dir, "config.json"))  # before any weight is read
    mesh = make_mesh(flags.tensor, flags.fsdp)
    model = models.load_pretrained(flags.model_dir, mesh=mesh, **overrides)
    server = JudgeServer(model, name, mesh=mesh, max_batch=flags.max_batch,
                         batch_wait_s=flags.batch_wait_ms / 1000.0,
                         default_max_tokens=flags.default_max_tokens,
                         max_body_bytes=int(flags.max_body_mb * (1 << 20)))
    try:
        server.serve_forever(flags.host, flags.port)
    except OSError as e:
        raise cli.UsageError(f"--host {flags.host} --port {flags.port}: cannot listen ({e.strerror or e})") from None
    return 0
