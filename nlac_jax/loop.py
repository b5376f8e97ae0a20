"""The NLAC loop (run by `python -m nlac_jax.train`, see train.py for the command line).

Each iteration: collect episodes with π_θ → push transitions to the replay buffer → build targets (critic:
language Bellman backups with θ̄; policy: critique + refinement with θ) → K sharded train steps (L1 + L2, EMA
θ̄ update inside the step) → held-out evaluation every E iterations → checkpoint every C iterations.

Every random choice is a function of (seed, iteration, phase), and the loop's own state (buffer, task cursor,
iteration) is saved with θ, θ̄, the optimiser and the PRNG key, so a run killed at any moment and resumed with
the same command ends in the same state as an uninterrupted run (on CPU).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from typing import Any

import gin

log = logging.getLogger("nlac_jax.loop")

PHASES = ("collect", "targets", "train", "eval")


# ----------------------------------------------------------------------------- gin-configured pieces
@gin.configurable
@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """The schedule of one NLAC run (defaults: a small CPU-sized run; the gin run files set real values).

    iterations: outer iterations {collect → targets → train → eval → checkpoint}.
    episodes_per_iteration: training episodes collected per iteration; env_pool: env instances played at once.
    buffer_capacity: replay buffer size (FIFO).
    critic_examples / policy_examples: transitions sampled from the buffer per iteration for each kind.
    train_steps: optimiser steps per iteration; batch_size: examples per step (mixed kinds, cycled through the
      iteration's shuffled examples); max_len: tokens per example (prompts are left-truncated, counted).
    eval_every: evaluate every E iterations (and after the last); eval_episodes: held-out tasks (fixed set);
      eval_temperature: 0 = greedy; calibration_transitions: (s, a) pairs for the critic diagnostics.
    checkpoint_every / keep_checkpoints: in iterations.
    sampler_max_batch: prompts per sampler call; top_p: nucleus for every role.
    dump_examples: examples per kind written to workdir/examples/iter_XXXX.txt.
    export_hf: write θ as an HF directory (workdir/hf_export) at the end.
    seqio_task: read the tasks through this registered seqio Task (e.g. 'nlac_math', needs requirements-seqio.txt;
      configure it with `nlac_jax.data.task_source_from_seqio.*`) instead of `make_task_source`.
    """

    iterations: int = 4
    episodes_per_iteration: int = 8
    env_pool: int = 8
    max_turns: int | None = None
    buffer_capacity: int = 10_000
    critic_examples: int = 8
    policy_examples: int = 8
    train_steps: int = 2
    batch_size: int = 8
    max_len: int = 1024
    eval_every: int = 2
    eval_episodes: int = 8
    eval_temperature: float = 0.0
    calibration_transitions: int = 8
    checkpoint_every: int = 1
    keep_checkpoints: int = 2
    sampler_max_batch: int = 64
    top_p: float = 1.0
    seed: int = 0
    dump_examples: int = 2
    export_hf: bool = False
    seqio_task: str | None = None


@gin.configurable
def build_model(model_dir: str | None = None, *, dtype: str = "float32", param_dtype: str = "float32",
                scan_layers: bool = True, remat: str = "none", hidden_size: int = 64, intermediate_size: int = 128,
                num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
                model_type: str = "qwen2", tie_word_embeddings: bool = True, max_position_embeddings: int = 4096,
                tokenizer_vocab_size: int = 512):
    """(ModelConfig, tokenizer, HF directory or None). With `model_dir`: its config.json and tokenizer (weights are
    loaded later, straight into their shardings); without: a random model of the given size over the tiny
    in-process byte-level tokenizer (no downloads)."""
    from nlac_jax import models, text, tiny
    run = dict(dtype=dtype, param_dtype=param_dtype, scan_layers=scan_layers, remat=remat)
    if model_dir is not None:
        return models.ModelConfig.from_hf_file(model_dir, **run), text.load_tokenizer(model_dir), model_dir
    tok = tiny.make_tiny_tokenizer(vocab_size=tokenizer_vocab_size)
    cfg = models.ModelConfig(vocab_size=-(-len(tok) // 64) * 64, hidden_size=hidden_size,
                             intermediate_size=intermediate_size, num_layers=num_layers, num_heads=num_heads,
                             num_kv_heads=num_kv_heads, head_dim=head_dim, model_type=model_type,
                             attention_bias=model_type == "qwen2", tie_word_embeddings=tie_word_embeddings,
                             max_position_embeddings=max_position_embeddings, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id, **run)
    return cfg, tok, None


@gin.configurable
class ExternalModel:
    """A separate, frozen model for model-backed environment parts (20Q oracle, τ-bench user), greedy.

    model_dir: HF directory (required when an env factory uses oracle='model' or user='model').
    """

    def __init__(self, model_dir: str = gin.REQUIRED, dtype: str = "bfloat16", max_new_tokens: int = 128,
                 max_batch: int = 64):
        from nlac_jax import models, sampling, text
        self.model = models.load_pretrained(model_dir, dtype=dtype)
        self.sampler = sampling.Sampler(self.model.config)
        self.tok, self.max_new_tokens, self.max_batch = self.model.tokenizer, max_new_tokens, max_batch
        self.stop_ids = text.stop_token_ids(self.tok)

    def __call__(self, requests: list) -> list[str]:
        """requests: plain prompt strings (sent as one user message) or chat histories -> replies."""
        from nlac_jax import text
        chats = [[{"role": "user", "content": r}] if isinstance(r, str) else r for r in requests]
        ids = [text.encode_chat(self.tok, c, add_generation_prompt=True) for c in chats]
        out = []
        for i in range(0, len(ids), self.max_batch):
            res = self.sampler.generate(self.model.params, ids[i:i + self.max_batch], self.max_new_tokens,
                                        temperature=0.0, stop_token_ids=self.stop_ids, tokenizer=self.tok)
            out.extend(res.texts)
        return out


# ----------------------------------------------------------------------------- the run
class _Holder:
    """The current TrainState (the step donates the old one, so roles read it through this holder)."""
    state: Any = None


def _phase_seed(seed: int, iteration: int, phase: str) -> int:
    return (seed * 1_000_003 + iteration) * 16 + PHASES.index(phase)


class NLACRun:
    """Everything one run needs, built from the gin config: mesh, model, train step, sampler, envs, buffer."""

    def __init__(self, workdir: str, restore: bool = True, checkpoint: str | None = None):
        import jax
        import numpy as np
        from nlac_jax import envs, sampling, sharding, training
        from nlac_jax.models import hf_io
        from nlac_jax.nlac import model_roles, prompts as prompts_lib, targets
        from nlac_jax.rl import ReplayBuffer

        self.workdir = os.path.abspath(workdir)
        os.makedirs(self.workdir, exist_ok=True)
        self.loop = LoopConfig()
        self.target_cfg = targets.TargetConfig()
        self.env_factory = envs.make_env_factory()
        self.env_name = self.env_factory.env_name
        self.task_source = self._task_source()
        self.prompts = prompts_lib.PromptSet(task=self.env_name)
        self.mesh = sharding.make_mesh()
        self.cfg, self.tokenizer, model_dir = build_model()
        self.optimizer = training.make_optimizer()
        self.step_fn = training.make_train_step(self.cfg, self.mesh, self.optimizer)
        self.checkpointer = training.Checkpointer(os.path.join(self.workdir, "checkpoints"),
                                                  save_every=self.loop.checkpoint_every,
                                                  keep=self.loop.keep_checkpoints)
        self.holder = _Holder()
        self.buffer = ReplayBuffer(self.loop.buffer_capacity)
        self.cursor = self.task_source.iterate(self.task_source.train_split, seed=self.loop.seed)
        self.start_iteration = 0

        ckpt_dir = checkpoint or self.checkpointer.directory
        have_ckpt = restore and self.checkpointer.latest_step() is not None
        if checkpoint is not None:
            have_ckpt = True
            if os.path.abspath(checkpoint) != self.checkpointer.directory:
                self.checkpointer = training.Checkpointer(checkpoint, save_every=self.loop.checkpoint_every,
                                                          keep=self.loop.keep_checkpoints)
        if have_ckpt:
            abstract = training.abstract_train_state(self.cfg, self.mesh, self.optimizer)
            restored = self.checkpointer.restore(abstract)
            self.holder.state = restored.state
            ls = restored.loop_state
            self.start_iteration = int(ls.get("iteration", 0))
            if "buffer" in ls:
                self.buffer.load_state_dict(ls["buffer"])
            if "cursor" in ls:
                self.cursor.load_state_dict(ls["cursor"])
            log.info("resumed from %s step %d (iteration %d)", ckpt_dir, restored.step, self.start_iteration)
        else:
            params = None
            if model_dir is not None:
                from nlac_jax import models
                params = hf_io.load_params(model_dir, self.cfg, models.param_shardings(self.cfg, self.mesh))
            self.holder.state = training.create_train_state(self.cfg, self.mesh, self.optimizer, params=params,
                                                            seed=self.loop.seed, donate_params=params is not None)

        self.sampler = sampling.Sampler(self.cfg, mesh=self.mesh)
        holder = self.holder
        self.roles = model_roles.ModelRoleSampler(
            self.sampler, self.tokenizer,
            get_params=lambda which: holder.state.params if which == "policy" else holder.state.target_params,
            temperatures=self.target_cfg.temperatures, max_new_tokens=self.target_cfg.max_new_tokens,
            top_p=self.loop.top_p, max_batch=self.loop.sampler_max_batch, seed=self.loop.seed)
        needs_model = (self.env_name == "twenty_questions" and self.env_factory.oracle == "model") or \
            (self.env_name.startswith("tau_") and self.env_factory.user == "model")
        generate_fn = ExternalModel() if needs_model else None
        self.envs = self.env_factory.make(self.loop.env_pool, generate_fn)
        self.judge_env = self.env_factory(generate_fn)
        self.eval_tasks = self.task_source.tasks(self.task_source.eval_split)[: self.loop.eval_episodes]
        self._np = np
        self._jax = jax

    def _task_source(self):
        from nlac_jax import data, envs
        if self.loop.seqio_task is None:
            return envs.make_task_source()
        env = data.env_name_from_seqio(self.loop.seqio_task)
        if env != self.env_name:
            raise ValueError(f"LoopConfig.seqio_task={self.loop.seqio_task!r} holds {env!r} tasks but "
                             f"make_env_factory.env_name={self.env_name!r}")
        return data.task_source_from_seqio(self.loop.seqio_task)

    # ------------------------------------------------------------------ one iteration
    def _pack(self, examples, rng):
        from nlac_jax import text
        items = [text.chat_example(self.tokenizer, **e.to_training_dict()) for e in examples]
        order = rng.permutation(len(items)) if items else []
        items = [items[i] for i in order]
        B, pad = self.loop.batch_size, self.tokenizer.pad_token_id or 0
        batches = []
        for s in range(self.loop.train_steps):
            chunk = [items[(s * B + j) % len(items)] for j in range(min(B, len(items)))]
            batches.append(text.pack_examples(chunk, self.loop.max_len, pad_id=pad, batch_size=B))
        return batches

    def iteration(self, it: int, bars) -> tuple[dict, str]:
        """One NLAC iteration. Returns (metrics, human-readable example dump)."""
        from nlac_jax.envs.base import episode_metrics
        from nlac_jax.nlac import targets
        from nlac_jax.rl import rollout
        np, loop, m = self._np, self.loop, {"iteration": it + 1}

        # collect
        t0 = time.perf_counter()
        self.roles.start_phase(_phase_seed(loop.seed, it, "collect"))
        bars("collect")
        tasks = self.cursor.take(loop.episodes_per_iteration)
        episodes, transitions = rollout.collect(self.envs, tasks, rollout.make_policy_fn(self.roles, self.prompts),
                                                task_name=self.env_name, max_turns=loop.max_turns)
        self.buffer.add(transitions)
        m.update({f"collect/{k}": v for k, v in episode_metrics(episodes).items()})
        m.update(self.roles.counters.as_dict("collect/gen/"))
        m.update(self.buffer.stats())
        m["time/collect"] = time.perf_counter() - t0

        # targets
        t0 = time.perf_counter()
        self.roles.start_phase(_phase_seed(loop.seed, it, "targets"))
        bars("targets")
        rng = np.random.default_rng([loop.seed, it, 7])
        critic_t = self.buffer.sample(min(loop.critic_examples, len(self.buffer)), rng)
        policy_t = self.buffer.sample(min(loop.policy_examples, len(self.buffer)), rng)
        stats = targets.TargetStats()
        critic = targets.build_critic_examples(critic_t, self.roles, self.target_cfg, self.prompts, stats)
        policy = targets.build_policy_examples(policy_t, self.roles, self.target_cfg, self.prompts, stats)
        examples = targets.trainable(critic + policy)
        m.update(stats.as_dict("nlac/"))
        m.update(self.roles.counters.as_dict("targets/gen/"))
        m["time/targets"] = time.perf_counter() - t0
        dump = targets.format_examples_for_humans(critic + policy, n=loop.dump_examples)

        # train
        t0 = time.perf_counter()
        bars("train")
        sums: dict = {}
        n_trunc = n_tokens = 0
        if examples:
            for batch in self._pack(examples, rng):
                self.holder.state, metrics = self.step_fn(self.holder.state, batch)
                n_trunc += batch.num_truncated
                for k, v in self._jax.device_get(metrics).items():
                    sums.setdefault(k, []).append(float(v))
                n_tokens += int(batch.attention_mask.sum())
            self.step_fn.check()
        for k in ("loss", "l1", "l2", "grad_norm", "learning_rate"):
            if k in sums:
                m[f"train/{k}"] = float(np.mean(sums[k]))
        for k in ("critic_tokens", "policy_tokens", "skipped"):
            if k in sums:
                m[f"train/{k}"] = float(np.sum(sums[k]))
        m["train/steps"] = len(sums.get("loss", []))
        m["train/step"] = int(self._jax.device_get(self.holder.state.step))
        m["train/truncated_examples"] = n_trunc
        m["time/train"] = time.perf_counter() - t0
        m["train/tokens_per_s"] = n_tokens / max(m["time/train"], 1e-9)

        # eval
        if (it + 1) % loop.eval_every == 0 or it + 1 == loop.iterations:
            m.update(self.evaluate(it, bars))
        return m, dump

    def evaluate(self, it: int, bars=lambda phase: None, params: str = "policy") -> dict:
        from nlac_jax.rl import rollout
        t0 = time.perf_counter()
        self.roles.start_phase(_phase_seed(self.loop.seed, it, "eval"))
        bars("eval")
        m, _ = rollout.evaluate(self.envs, self.eval_tasks, self.roles, self.prompts, self.judge_env,
                                params=params, temperature=self.loop.eval_temperature,
                                calibration_transitions=self.loop.calibration_transitions,
                                max_turns=self.loop.max_turns)
        m["time/eval"] = time.perf_counter() - t0
        return m

    def save(self, it: int) -> None:
        loop_state = {"iteration": it + 1, "buffer": self.buffer.state_dict(), "cursor": self.cursor.state_dict()}
        force = it + 1 == self.loop.iterations
        self.checkpointer.save(self.holder.state, metadata={"env": self.env_name, "iteration": it + 1},
                               loop_state=loop_state, step=it + 1, force=force)


# ----------------------------------------------------------------------------- logging
class MetricsWriter:
    """metrics.jsonl (+ TensorBoard events) in the workdir, process 0 only. On resume, lines of iterations that
    will be re-run are dropped, so the file always holds exactly one line per finished iteration."""

    def __init__(self, workdir: str, start_iteration: int, enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.tb = None
        if not enabled:
            return
        if os.path.exists(self.path):
            with open(self.path) as f:
                keep = [ln for ln in f if ln.strip() and json.loads(ln).get("iteration", 0) <= start_iteration]
            with open(self.path, "w") as f:
                f.writelines(keep)
        try:
            from tensorboardX import SummaryWriter
            self.tb = SummaryWriter(os.path.join(workdir, "tb"))
        except ImportError:  # optional
            self.tb = None

    def write(self, m: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in m.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean, sort_keys=True) + "\n")
        if self.tb is not None:
            for k, v in m.items():
                if isinstance(v, (int, float)) and k != "iteration" and math.isfinite(v):
                    self.tb.add_scalar(k, v, m["iteration"])
            self.tb.flush()

    def close(self):
        if self.tb is not None:
            self.tb.close()


SUMMARY_KEYS = (("collect/success_rate", "train success"), ("collect/mean_return", "train return"),
                ("train/l1", "L1 critic"), ("train/l2", "L2 policy"), ("nlac/frac_optimal", "judged optimal"),
                ("eval/success_rate", "eval success"), ("eval/mean_return", "eval return"),
                ("eval/calib/return_mae", "calib MAE"), ("eval/verdict/accuracy", "verdict acc"),
                ("time/collect", "t collect"), ("time/targets", "t targets"), ("time/train", "t train"),
                ("time/eval", "t eval"))


def summary_table(rows: list[dict]) -> str:
    """A fixed-width table of the key metrics, one row per iteration."""
    cols = [(k, n) for k, n in SUMMARY_KEYS if any(k in r for r in rows)]
    head = "iter | " + " | ".join(f"{n:>14}" for _, n in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = []
        for k, _ in cols:
            v = r.get(k)
            cells.append(f"{v:>14.3f}" if isinstance(v, (int, float)) and v is not None else f"{'-':>14}")
        lines.append(f"{r['iteration']:>4} | " + " | ".join(cells))
    return "\n".join(lines)


def run(workdir: str) -> list[dict]:
    """Run (or resume) the gin-configured NLAC loop in `workdir`. Returns the metrics of this invocation."""
    import jax
    from tqdm import tqdm

    t_start = time.perf_counter()
    r = NLACRun(workdir)
    main_proc = jax.process_index() == 0
    if main_proc:
        with open(os.path.join(r.workdir, "config.gin"), "w") as f:
            f.write(gin.config_str())
    writer = MetricsWriter(r.workdir, r.start_iteration, enabled=main_proc)
    os.makedirs(os.path.join(r.workdir, "examples"), exist_ok=True)
    rows = []
    bar = tqdm(total=r.loop.iterations * len(PHASES), initial=r.start_iteration * len(PHASES),
               disable=not main_proc, desc="nlac", dynamic_ncols=True)

    for it in range(r.start_iteration, r.loop.iterations):
        done_phases = []

        def bars(phase, it=it):
            if done_phases:
                bar.update(1)
            done_phases.append(phase)
            bar.set_description(f"iter {it + 1}/{r.loop.iterations} {phase}")

        m, dump = r.iteration(it, bars)
        bar.update(len(PHASES) - len(done_phases) + 1)
        r.save(it)
        if main_proc:
            with open(os.path.join(r.workdir, "examples", f"iter_{it + 1:04d}.txt"), "w") as f:
                f.write(dump)
        writer.write(m)
        rows.append(m)
    bar.close()
    r.checkpointer.wait()
    if r.loop.export_hf and main_proc:
        from nlac_jax import training
        training.export_hf(os.path.join(r.workdir, "hf_export"), r.cfg, r.holder.state)
        r.tokenizer.save_pretrained(os.path.join(r.workdir, "hf_export"))
    r.checkpointer.close()
    writer.close()
    if main_proc and rows:
        print("\n" + summary_table(rows))
        try:
            from nlac_jax import plot
            png = plot.plot_workdir(r.workdir)
            print(f"\nlearning curves: {png}")
        except Exception as e:  # plotting must never fail a finished run
            log.warning("plotting failed: %s", e)
        print(f"metrics: {writer.path}\nexamples: {os.path.join(r.workdir, 'examples')}\n"
              f"wall time: {time.perf_counter() - t_start:.1f} s")
    return rows
