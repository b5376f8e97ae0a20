"""Models built from the run's gin config: the trained model (`build_model`) and the frozen external model of
model-backed environment parts (`ExternalModel`: the 20Q oracle, the τ-bench user).

Both are gin configurables (`build_model.*`, `ExternalModel.*` in gin/models and gin/runs); `external_model.kind`
chooses between the local `ExternalModel` and an OpenAI-compatible endpoint (`nlac_jax.judges.OpenAIChatModel`).
The heavy imports stay inside the functions: importing this module (gin files do, to register the names) builds
nothing.
"""

from __future__ import annotations

import os

import gin
from nlac_jax import models, sampling, text
from nlac_jax.judges.client import OpenAIChatModel
from nlac_jax.parallel import sharding
from nlac_jax.storage import fs
from nlac_jax.testing import tiny

# build_model resolves relative model directories against the repository root (nlac_jax/runner/building.py -> ../..)
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@gin.configurable
def build_model(model_dir: str | None = None, *, dtype: str = "float32", param_dtype: str = "float32",
                scan_layers: bool = True, remat: str = "none", attn_query_block: int = 128, hidden_size: int = 64,
                intermediate_size: int = 128, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
                model_type: str = "qwen2", tie_word_embeddings: bool = True, max_position_embeddings: int = 4096,
                tokenizer_vocab_size: int = 512, hf_config: dict | None = None):
    """(ModelConfig, tokenizer, HF directory or None). With `model_dir`: its config.json and tokenizer (weights are
    loaded later, straight into their shardings); without: a random model of the given size over the tiny
    in-process byte-level tokenizer (no downloads). A relative `model_dir` that does not exist from the current
    directory is looked up from the repository root (gin files name shipped models, e.g. the demo's warm start).

    hf_config: the model's config.json fields, written in its gin model file (gin/models/*.gin). Without a
    `model_dir` they define the model (ModelConfig.from_hf_dict; no tokenizer: returns (cfg, None, None)), which is
    all the planner (`nlac_jax.plan`) needs; with one, every field given must equal config.json's (a mismatch is a
    ConfigError naming the field and both values), so the gin file cannot describe another model than it loads.

    Random model shapes: embedding [vocab_size, hidden_size] with vocab_size = len(tokenizer) rounded up to a
    multiple of 64; num_layers layers of num_heads query / num_kv_heads key-value heads of head_dim each."""
    run = dict(dtype=dtype, param_dtype=param_dtype, scan_layers=scan_layers, remat=remat,
               attn_query_block=attn_query_block)
    if hf_config is not None and not isinstance(hf_config, dict):
        raise models.ConfigError(f"build_model.hf_config = {hf_config!r}: expected a dict of config.json fields")
    if model_dir is not None:
        if not fs.is_remote(model_dir) and not os.path.isabs(model_dir) and not os.path.exists(model_dir) and \
                os.path.isdir(os.path.join(_REPO_ROOT, model_dir)):
            model_dir = os.path.join(_REPO_ROOT, model_dir)
        if hf_config is not None:
            _check_hf_config(hf_config, model_dir)
        cfg, tok = models.ModelConfig.from_hf_file(model_dir, **run), text.load_tokenizer(model_dir)
        models.check_tokenizer(cfg, tok, model_dir)
        return cfg, tok, model_dir
    if hf_config is not None:
        return models.ModelConfig.from_hf_dict(dict(hf_config), source="gin build_model.hf_config", **run), None, None
    tok = tiny.make_tiny_tokenizer(vocab_size=tokenizer_vocab_size)
    cfg = models.ModelConfig(vocab_size=-(-len(tok) // 64) * 64, hidden_size=hidden_size,
                             intermediate_size=intermediate_size, num_layers=num_layers, num_heads=num_heads,
                             num_kv_heads=num_kv_heads, head_dim=head_dim, model_type=model_type,
                             attention_bias=model_type == "qwen2", tie_word_embeddings=tie_word_embeddings,
                             max_position_embeddings=max_position_embeddings, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id, **run)
    return cfg, tok, None


def _check_hf_config(hf_config: dict, model_dir: str) -> None:
    """Every field of the gin file's hf_config must equal the model directory's config.json (ConfigError otherwise)."""
    import json
    path = fs.join(model_dir, "config.json")
    if not fs.isfile(path):
        return  # from_hf_file reports the missing file
    d = json.loads(fs.read_text(path))
    for key, want in hf_config.items():
        have = d.get(key)
        if have != want and not (isinstance(want, (list, tuple)) and list(want) == have):
            raise models.ConfigError(f"{path}: {key} = {have!r}, but build_model.hf_config (the gin model file) says "
                                     f"{want!r}: MODEL_DIR holds another model than the gin file describes")


@gin.configurable
class ExternalModel:
    """A separate, frozen model for model-backed environment parts (20Q oracle, τ-bench user), greedy.

    model_dir: HF directory (required when an env factory uses oracle='model' or user='model').
    sharded: place the weights on the run's mesh (`sharding.make_mesh()`, as gin configures it) instead of one
      device: a 7B user simulator is 15 GB in bfloat16, half of a v4 chip next to its share of the train state.
    """

    def __init__(self, model_dir: str = gin.REQUIRED, dtype: str = "bfloat16", max_new_tokens: int = 128,
                 max_batch: int = 64, sharded: bool = True):
        mesh = sharding.make_mesh() if sharded else None
        self.model = models.load_pretrained(model_dir, dtype=dtype, mesh=mesh)
        self.sampler = sampling.Sampler(self.model.config, mesh=mesh)
        self.tok, self.max_new_tokens, self.max_batch = self.model.tokenizer, max_new_tokens, max_batch
        self.stop_ids = text.stop_token_ids(self.tok)

    def __call__(self, requests: list) -> list[str]:
        """requests: plain prompt strings (sent as one user message) or chat histories -> replies (one per request,
        at most max_new_tokens tokens each; generated in chunks of max_batch prompts)."""
        chats = [[{"role": "user", "content": r}] if isinstance(r, str) else r for r in requests]
        ids = [text.encode_chat(self.tok, c, add_generation_prompt=True) for c in chats]
        out = []
        for i in range(0, len(ids), self.max_batch):
            res = self.sampler.generate(self.model.params, ids[i:i + self.max_batch], self.max_new_tokens,
                                        temperature=0.0, stop_token_ids=self.stop_ids, tokenizer=self.tok)
            out.extend(res.texts)
        return out


EXTERNAL_KINDS = ("local", "openai")


@gin.configurable
def external_model(kind: str = "local", endpoint_only: bool | str = False):
    """The model behind model-backed environment parts, with the `ExternalModel` call contract
    (`model(list of prompt strings or chat histories) -> list[str]`).

    kind: 'local' (`ExternalModel`: our sampler in this process) or 'openai' (`judges.OpenAIChatModel`: any
    OpenAI-compatible chat endpoint, e.g. vLLM or `python -m nlac_jax.serve`; configure `OpenAIChatModel.*`).
    endpoint_only: return None for 'local' (a call-site argument, not a gin setting): the loop builds an endpoint
    client first, to check it before anything compiles, and loads a local model later, after its cheaper checks;
    'bindings' also builds the client without its cache directory (``check_endpoint_bindings``).
    The caller runs the model's `check()` when it has one (the loop does, at start-up)."""
    if kind == "local":
        return None if endpoint_only else ExternalModel()
    if kind == "openai":
        return OpenAIChatModel(**({"cache_dir": None} if endpoint_only == "bindings" else {}))
    raise ValueError(f"external_model.kind must be one of {EXTERNAL_KINDS}, got {kind!r}")


NL_JUDGE_MODES = ("auto", "on", "off")


@gin.configurable
def nl_assertion_judge(external=None, enabled: str = "auto", max_tokens: int = 1024, dry: bool = False):
    """The model that judges τ-bench's NL assertions (`envs.tau_judge`), or None.

    It is a `judges.OpenAIChatModel` on the user simulator's endpoint (`external.derive`: the same URL, model, key
    variable and cache; without one, the `OpenAIChatModel.*` bindings), with its own `max_tokens`: a verdict and its
    reasoning per assertion need more room than a user turn.
    external: the env's own model (a call-site argument): 'auto' judges when it is an endpoint.
    enabled: 'auto' (on when the τ-bench user runs behind an endpoint), 'on' (always; the bindings must name an
      endpoint) or 'off'.
    dry: a call-site argument: build without a cache directory (the configuration check builds it only to resolve
      the bindings).
    """
    if enabled not in NL_JUDGE_MODES:
        raise ValueError(f"nl_assertion_judge.enabled must be one of {NL_JUDGE_MODES}, got {enabled!r}")
    if enabled == "off" or (enabled == "auto" and not isinstance(external, OpenAIChatModel)):
        return None
    if isinstance(external, OpenAIChatModel):
        return external.derive(max_tokens=max_tokens)
    return OpenAIChatModel(max_tokens=max_tokens, **({"cache_dir": None} if dry else {}))


def check_endpoint_bindings(env_factory) -> None:
    """Resolve the endpoint bindings a run will use (the model oracle / user and the NL-assertion judge), without
    touching the network or the disk: a missing `%gin.REQUIRED` (e.g. `JUDGE_URL`) fails here, naming it."""
    if not env_factory.needs_model:
        return
    external = external_model(endpoint_only="bindings")
    if env_factory.env_name.startswith("tau_"):
        nl_assertion_judge(external, dry=True)
