"""Judges over HTTP: models behind an OpenAI-compatible chat endpoint, and our own sampler served behind one.

One concern per module:

* ``client.py``: ``OpenAIChatModel``, the client of any ``POST {base_url}/chat/completions`` endpoint (vLLM, OpenAI,
  ``python -m nlac_jax.serve``). It has the ``ExternalModel`` call contract (a list of prompt strings or chat histories
  -> reply strings), so gin can put an endpoint behind the 20Q model oracle or the τ-bench model user
  (``external_model.kind = 'openai'``). Batched, concurrent (bounded thread pool), retried, cached on disk;
* ``cache.py``: ``ResponseCache``, the crash-safe on-disk cache of responses by request hash;
* ``server.py``: the WSGI app and request batcher behind ``python -m nlac_jax.serve``.
"""

from nlac_jax.judges.cache import ResponseCache, request_key
from nlac_jax.judges.client import JudgeError, OpenAIChatModel

__all__ = ["JudgeError", "OpenAIChatModel", "ResponseCache", "request_key"]
