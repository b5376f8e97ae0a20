"""The NLAC loop (run by `python -m nlac_jax.train`, see cli/train.py for the command line).

Each iteration: collect episodes with π_θ → push transitions to the replay buffer → build targets (critic:
language Bellman backups with θ̄; policy: critique + refinement with θ) → K sharded train steps (L1 + L2, EMA
θ̄ update inside the step) → held-out evaluation every E iterations → checkpoint every C iterations.

Every random choice is a function of (seed, iteration, phase), and the loop's own state (buffer, task cursor,
iteration) is saved with θ, θ̄, the optimiser and the PRNG key, so a run killed at any moment and resumed with
the same command ends in the same state as an uninterrupted run (on CPU).

Its schedule is runner/config.py (`LoopConfig`), its start-up prompt checks runner/startup.py, its files
runner/workdir.py. The model it trains comes from runner/building.py (`build_model`, `ExternalModel`), its batches
from training/batching.py (`pack_train_batches`), its metrics.jsonl and summary table from observability/metrics.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from nlac_jax import data, envs, models, sampling, text, training
from nlac_jax.envs.base import episode_metrics, success_by_group
from nlac_jax.models import hf_io
from nlac_jax.nlac import algorithm, evaluation, model_roles, prompts as prompts_lib, targets
from nlac_jax.observability import plots
from nlac_jax.observability.metrics import MetricsWriter, summary_table
from nlac_jax.parallel import compilations, sharding
from nlac_jax.parallel.distributed import Processes
from nlac_jax.planning import footprint
from nlac_jax.rl import ReplayBuffer, rollout
from nlac_jax.rl.roles import RoleSampling
from nlac_jax.runner import interrupts, run_lock
from nlac_jax.storage import fs
from nlac_jax.training import batching
from nlac_jax.training.prefix_packing import pack_shared_prefix
# config, startup and workdir hold the run's schedule, its start-up checks and its files; the loop re-exports them
from nlac_jax.runner.config import PHASES, LoopConfig  # noqa: F401
from nlac_jax.runner.startup import check_initial_prompts, initial_states  # noqa: F401
from nlac_jax.runner.workdir import finished_iterations, latest_checkpoint_step, write_config_gin  # noqa: F401
# gin files that `import nlac_jax.runner.loop` bind build_model.*, ExternalModel.*, external_model.* and
# OpenAIChatModel.*: these imports are what register them (before the files are parsed).
from nlac_jax.judges.client import OpenAIChatModel  # noqa: F401  (registers OpenAIChatModel.* with gin)
from nlac_jax.runner.building import ExternalModel, build_model, external_model, nl_assertion_judge  # noqa: F401

log = logging.getLogger("nlac_jax.runner.loop")


# ----------------------------------------------------------------------------- the run
class _Holder:
    """The current TrainState (the step donates the old one, so roles read it through this holder)."""
    state: Any = None


@dataclasses.dataclass(frozen=True)
class ModelOnlyState:
    """What the roles read of a TrainState when a model is evaluated as it is (`NLACRun(model_only=True)`, i.e.
    `nlac_jax.evaluate --model_dir`): θ = θ̄ = its weights, and no optimiser state, step or EMA to build."""
    params: Any

    @property
    def target_params(self):
        return self.params


def _pack_totals(parts: list[dict]) -> dict:
    """The packing metrics of one iteration's parts (`_pack`'s, one per state a learner's `train_plan` trains):
    counts summed, train/updates_per_target as the whole iteration's ratio; one part's as they are."""
    if len(parts) == 1:
        return parts[0]
    out = {k: sum(p[k] for p in parts) for k in parts[0]}
    n = out.get("train/examples", 0)
    out["train/updates_per_target"] = sum(p["train/updates_per_target"] * p["train/examples"] for p in parts) / n \
        if n else 0.0
    return out


def _phase_seed(seed: int, iteration: int, phase: str) -> int:
    """A non-negative seed per (seed, iteration, phase); iteration -1 is the evaluation before any training."""
    return (seed * 1_000_003 + iteration + 1) * 16 + PHASES.index(phase)


def run_optimizer(loop: LoopConfig) -> training.Optimizer:
    """The run's optimizer: gin's `make_optimizer` / `make_schedule`, with the learning rate multiplied by
    loop.critic_warmup_lr_scale over the critic-only warm-up's critic_warmup_iterations * train_steps updates."""
    boost = loop.critic_warmup_lr_scale
    if boost == 1:
        return training.make_optimizer()
    return training.make_optimizer(training.make_schedule(
        boost_steps=loop.critic_warmup_iterations * loop.train_steps, boost_factor=float(boost)))


class NLACRun:
    """Everything one run needs, built from the gin config: mesh, model, train step, sampler, envs, buffer."""

    def __init__(self, workdir: str, restore: bool = True, checkpoint: str | None = None, model_only: bool = False):
        """model_only: the gin-configured model's own weights (build_model's model_dir) act and judge, as they are
        (ModelOnlyState): no checkpoint is read or written and no TrainState is built; for evaluation only."""
        import jax
        import numpy as np

        self.stop: interrupts.StopRequest | None = None  # run() installs the SIGTERM flag
        self.workdir = fs.abspath(workdir)  # a gs:// URL stays one (no os.path on it)
        fs.makedirs(self.workdir)
        # several processes (a TPU pod): the envs are divided, everything else is the same on every process
        # (nlac_jax/parallel/distributed.py); one process: every exchange is local
        self.processes = Processes.current()
        self.loop = LoopConfig()
        self.target_cfg = targets.TargetConfig()
        self.sampling = RoleSampling()  # how every role is sampled, for acting, targets and evaluation alike
        self.env_factory = envs.make_env_factory()
        self.env_name = self.env_factory.env_name
        needs_model = self.env_factory.needs_model
        # an endpoint-backed oracle / user first: an unreachable judge fails here, before anything compiles (a local
        # ExternalModel loads later, after the start-up checks, as its weights take a while)
        self.external = external_model(endpoint_only=True) if needs_model else None
        # τ-bench's NL assertions are judged on the same endpoint when the user runs behind one (nl_assertion_judge)
        self.nl_judge = nl_assertion_judge(self.external) if self.env_name.startswith("tau_") and needs_model \
            else None
        for endpoint in (self.external, self.nl_judge):
            check = getattr(endpoint, "check", None)
            if callable(check):  # an endpoint (judges.OpenAIChatModel): reachable, key accepted, model served
                check()
        self.task_source = self._task_source()
        self.prompts = prompts_lib.PromptSet(task=self.env_name)
        self.mesh = sharding.make_mesh()
        self.cfg, self.tokenizer, model_dir = build_model()
        self._fit_prompts()
        self.optimizer = run_optimizer(self.loop)
        self.step_fn = training.make_train_step(self.cfg, self.mesh, self.optimizer)
        if jax.process_index() == 0:  # what each chip holds of θ, per parameter class (the planner's numbers)
            log.info("%s", footprint.param_class_table(self.cfg, self.mesh))
        # stored with every checkpoint: resuming with another model or task is refused by name, not inside orbax
        fingerprint = training.run_fingerprint(self.cfg, env=self.env_name)
        self.checkpointer = None if model_only else training.Checkpointer(
            fs.join(self.workdir, "checkpoints"), save_every=self.loop.checkpoint_every,
            keep=self.loop.keep_checkpoints, fingerprint=fingerprint)
        self.holder = _Holder()
        self.buffer = ReplayBuffer(self.loop.buffer_capacity)
        self.learner = algorithm.NLAC()  # the default learner (the experiments plug in others)
        self.cursor = self.task_source.iterate(self.task_source.train_split, seed=self.loop.seed)
        self.start_iteration = 0

        if model_only and (checkpoint is not None or model_dir is None):
            raise ValueError("NLACRun(model_only=True) evaluates build_model.model_dir's weights: it needs a "
                             "model directory and no checkpoint")
        ckpt_dir = checkpoint or getattr(self.checkpointer, "directory", None)
        # decided once, on process 0, and broadcast (latest_checkpoint_step): every process restores the same step
        look = (restore or checkpoint is not None) and not model_only  # the same on every process
        latest = latest_checkpoint_step(ckpt_dir, self.processes) if look else None
        have_ckpt = latest is not None
        if checkpoint is not None:
            have_ckpt = True  # a named checkpoint with no step in it is an error (CheckpointRestoreError), not a fresh start
            if fs.abspath(checkpoint) != self.checkpointer.directory:
                self.checkpointer = training.Checkpointer(checkpoint, save_every=self.loop.checkpoint_every,
                                                          keep=self.loop.keep_checkpoints, fingerprint=fingerprint)
        if have_ckpt:
            abstract = training.abstract_train_state(self.cfg, self.mesh, self.optimizer)
            restored = self.checkpointer.restore(abstract, step=latest)
            self.holder.state = restored.state
            ls = restored.loop_state
            self.start_iteration = int(ls.get("iteration", 0))
            if "buffer" in ls:  # the segment index, or (a checkpoint of before segments) every transition in full
                self.buffer.load_checkpoint(ls["buffer"], restored.files)
            if "cursor" in ls:
                self.cursor.load_state_dict(ls["cursor"])
            log.info("resumed from %s step %d (iteration %d)", ckpt_dir, restored.step, self.start_iteration)
        elif model_only:
            self.holder.state = ModelOnlyState(hf_io.load_params(model_dir, self.cfg,
                                                                 models.param_shardings(self.cfg, self.mesh)))
        else:
            params = None
            if model_dir is not None:
                params = hf_io.load_params(model_dir, self.cfg, models.param_shardings(self.cfg, self.mesh))
            self.holder.state = training.create_train_state(self.cfg, self.mesh, self.optimizer, params=params,
                                                            seed=self.loop.seed, donate_params=params is not None)

        self.sampler = sampling.Sampler(self.cfg, mesh=self.mesh, min_batch_bucket=self.loop.sampler_min_batch,
                                        compact_levels=self.loop.sampler_compact_levels,
                                        min_shared_prefix=self.loop.sampler_shared_prefix,
                                        trunk_rows=self.loop.sampler_trunk_rows,
                                        prefix_store=self.loop.sampler_prefix_store,
                                        min_trunk=max(1, self.loop.sampler_shared_prefix))
        holder = self.holder
        self.roles = model_roles.ModelRoleSampler(
            self.sampler, self.tokenizer,
            get_params=lambda which: holder.state.params if which == "policy" else holder.state.target_params,
            settings=self.sampling, max_batch=self.loop.sampler_max_batch, seed=self.loop.seed)
        if needs_model and self.external is None:
            self.external = external_model()
        generate_fn = self.external
        # env_pool counts every process's envs: this process plays its share of each iteration's tasks
        self.envs = self.env_factory.make(-(-self.loop.env_pool // self.processes.count), generate_fn,
                                          self.nl_judge)
        self.judge_env = self.env_factory(generate_fn)
        held_out = self.task_source.tasks(self.task_source.eval_split)
        # more episodes than held-out tasks: each task is played again (a sampled policy's success is a mean)
        self.eval_tasks = [held_out[i % len(held_out)] for i in range(self.loop.eval_episodes)] if held_out else []
        self._np = np
        self._jax = jax

    def _fit_prompts(self) -> None:
        """The one prompt-fitting rule for acting and training, then the start-up check (before any weights load)."""
        max_len, context = self.loop.max_len, self.cfg.max_position_embeddings
        if context and max_len > context:
            raise ValueError(f"LoopConfig.max_len={max_len} exceeds the model context (max_position_embeddings="
                             f"{context}); lower LoopConfig.max_len")
        if self.loop.train_steps is not None and self.loop.train_steps < 1:
            raise ValueError(f"LoopConfig.train_steps must be >= 1 or None (one pass), got {self.loop.train_steps}")
        budgets = prompts_lib.prompt_budgets(max_len, self.sampling.max_new_tokens)
        self.fitter = text.PromptFitter(self.tokenizer, budgets, max_len=max_len)
        self.prompts.fitter = self.fitter
        states = initial_states(self.env_factory, self.task_source)
        self.initial_prompt_tokens = check_initial_prompts(states, self.prompts, self.fitter, task=self.env_name)
        log.info("initial prompt tokens (task %s, max over %d initial states) / budget: %s", self.env_name,
                 len(states), ", ".join(f"{r} {n}/{budgets[r]}" for r, n in self.initial_prompt_tokens.items()))

    def _task_source(self):
        if self.loop.seqio_task is None:
            return envs.make_task_source()
        env = data.env_name_from_seqio(self.loop.seqio_task)
        if env != self.env_name:
            raise ValueError(f"LoopConfig.seqio_task={self.loop.seqio_task!r} holds {env!r} tasks but "
                             f"make_env_factory.env_name={self.env_name!r}")
        return data.task_source_from_seqio(self.loop.seqio_task)

    # ------------------------------------------------------------------ one iteration
    def _pack(self, examples, rng, train_steps: int | None) -> tuple[list, dict]:
        """Token batches for `train_steps` train steps (`LoopConfig.train_steps`, or a state's share of them under a
        learner's `train_plan`), and their metrics (`batching.pack_train_batches`: examples longer than max_len are
        dropped and counted, never cut; train_steps=None is one pass)."""
        items = [batching.chat_example(self.tokenizer, **e.to_training_dict()) for e in examples]
        pad = self.tokenizer.pad_token_id or 0
        packer = None
        if self.loop.share_prefixes:
            rows = self.step_fn.packed_row_multiple
            packer = lambda c: pack_shared_prefix(c, self.loop.max_len, pad_id=pad, row_multiple=rows)  # noqa: E731
        batches, m = batching.pack_train_batches(items, rng, max_len=self.loop.max_len, batch_size=self.loop.batch_size,
                                             train_steps=train_steps, pad_id=pad, packer=packer)
        if m["train/dropped_examples"]:
            log.warning("%d of %d examples are longer than LoopConfig.max_len=%d (target too long): dropped",
                        m["train/dropped_examples"], len(items), self.loop.max_len)
        return batches, m

    def _phase(self, it: int, phase: str, bars) -> None:
        """The start of `phase` of 0-based iteration `it`: the progress bar, and the test hold point (interrupts)."""
        interrupts.hold_point(it, phase, self.processes.index, self.processes.count, self.stop)
        bars(phase)

    def iteration(self, it: int, bars, learner=None) -> tuple[dict, str]:
        """One iteration: collect → examples → train (→ eval). `learner` (default: NLAC, see nlac/algorithm.py) picks
        the iteration's tasks and turns its episodes into training examples; a learner with `routing()` (e.g. the
        frozen critic) has its roles served by its own parameter sets for the whole iteration, evaluation included.
        Returns (metrics, example dump)."""
        learner = learner or self.learner
        routes, param_sets = learner.routing() if hasattr(learner, "routing") else ({}, {})
        with self.roles.routing(routes, param_sets):
            return self._iteration(it, bars, learner)

    def _iteration(self, it: int, bars, learner) -> tuple[dict, str]:
        np, loop, m = self._np, self.loop, {"iteration": it + 1}
        compiled_before = compilations.snapshot()

        # collect
        t0 = time.perf_counter()
        self.roles.start_phase(_phase_seed(loop.seed, it, "collect"))
        self.fitter.reset_counters()
        self._phase(it, "collect", bars)
        tasks = learner.take_tasks(self, loop.episodes_per_iteration)
        episodes, transitions = rollout.collect(self.envs, tasks, evaluation.make_policy_fn(self.roles, self.prompts),
                                                task_name=self.env_name, max_turns=loop.max_turns,
                                                processes=self.processes)
        m.update({f"collect/{k}": v for k, v in episode_metrics(episodes).items()})
        m.update({f"collect/{k}": v for k, v in success_by_group(episodes, self.judge_env).items()})
        m["collect/episodes_this_process"] = len(self.processes.share(tasks))  # the others are gathered
        m.update(self.roles.counters.as_dict("collect/gen/"))
        m.update(self.fitter.reset_counters().as_dict("collect/prompt/"))
        m["time/collect"] = time.perf_counter() - t0

        # targets
        t0 = time.perf_counter()
        self.roles.start_phase(_phase_seed(loop.seed, it, "targets"))
        self._phase(it, "targets", bars)
        rng = np.random.default_rng([loop.seed, it, 7])
        examples, dump = learner.examples(self, it, episodes, transitions, rng, m)
        m.update(self.roles.counters.as_dict("targets/gen/"))
        m.update(self.fitter.reset_counters().as_dict("targets/prompt/"))
        m["time/targets"] = time.perf_counter() - t0

        # train
        t0 = time.perf_counter()
        self._phase(it, "train", bars)
        n_tokens = self._train(learner, examples, rng, m)
        m["time/train"] = time.perf_counter() - t0
        m["train/tokens_per_s"] = n_tokens / max(m["time/train"], 1e-9)

        # eval
        if (it + 1) % loop.eval_every == 0 or it + 1 == loop.iterations:
            m.update(self.evaluate(it, bars))
        # an endpoint-backed oracle / user (judges.OpenAIChatModel): its request, cache and token counters, cumulative
        # since this process started
        for prefix, endpoint in (("judge", self.external), ("nl_judge", self.nl_judge)):
            endpoint_metrics = getattr(endpoint, "metrics", None)
            if callable(endpoint_metrics):
                m.update({f"{prefix}/{k}": v for k, v in endpoint_metrics().items()})
        new = compilations.since(compiled_before)
        m["compile/count"] = sum(new.values())
        if new and it > self.start_iteration:  # the first iteration compiles everything; later ones should not
            log.warning("iteration %d compiled %d new executable(s): %s", it + 1, sum(new.values()),
                        ", ".join(f"{k} x{v}" for k, v in sorted(new.items())))
        return m, dump

    def _train(self, learner, examples, rng, m: dict) -> int:
        """The train phase's steps on `examples`, its metrics into `m`; returns the tokens trained on. A learner
        with `train_plan(run, examples)` -> [(holder, examples, train_steps)] trains each holder's state on its part
        (the split critic: L1 to its own state, L2 to the run's); any other trains the run's state on all."""
        np, loop = self._np, self.loop
        # the sampler's inference copies of θ and θ̄ (and of a learner's own state: the split critic's) are stale
        # after this phase's updates; the next sample rebuilds them from the new arrays
        self.sampler.release()
        sums: dict = {}
        n_tokens = 0
        plan = learner.train_plan(self, examples) if hasattr(learner, "train_plan") else \
            [(self.holder, examples, loop.train_steps)]
        packed = []
        for holder, part, steps in plan or [(self.holder, [], loop.train_steps)]:
            batches, pack_metrics = self._pack(part, rng, steps)
            packed.append(pack_metrics)
            if batches:
                for batch in batches:
                    # every process packed the same batches: each places the rows its devices own
                    holder.state, metrics = self.step_fn(holder.state, self.step_fn.from_replicated(batch))
                    for k, v in self._jax.device_get(metrics).items():
                        sums.setdefault(k, []).append(float(v))
                    n_tokens += int(batch.attention_mask.sum())
                self.step_fn.check()
        m.update(_pack_totals(packed))
        for k in ("loss", "l1", "l2", "grad_norm", "learning_rate"):
            if k in sums:
                m[f"train/{k}"] = float(np.mean(sums[k]))
        for k in ("critic_tokens", "policy_tokens", "skipped"):
            if k in sums:
                m[f"train/{k}"] = float(np.sum(sums[k]))
        m["train/steps"] = len(sums.get("loss", []))
        m["train/step"] = int(self._jax.device_get(self.holder.state.step))
        return n_tokens

    def evaluate(self, it: int, bars=lambda phase: None, params: str = "policy") -> dict:
        t0 = time.perf_counter()
        self.roles.start_phase(_phase_seed(self.loop.seed, it, "eval"))
        self.fitter.reset_counters()
        self._phase(it, "eval", bars)
        m, _ = evaluation.evaluate(self.envs, self.eval_tasks, self.roles, self.prompts, self.judge_env,
                                params=params,
                                calibration_transitions=self.loop.calibration_transitions,
                                score_transitions=self.loop.score_transitions,
                                max_turns=self.loop.max_turns, processes=self.processes)
        m.update(self.roles.counters.as_dict("eval/gen/"))
        m.update(self.fitter.reset_counters().as_dict("eval/prompt/"))
        m["eval/episodes_this_process"] = len(self.processes.share(self.eval_tasks))
        m["time/eval"] = time.perf_counter() - t0
        return m

    def _process_state(self, buffer_index: dict) -> dict:
        """What this process holds of the loop's state, recorded per process index in every checkpoint.

        buffer_sha256 covers the buffer's segment index, which lists every live segment with its sha256: equal
        indices mean equal buffers, and only the new segment was encoded and hashed for it."""
        import hashlib
        import json
        sha = hashlib.sha256(json.dumps(buffer_index, sort_keys=True).encode()).hexdigest()
        return {"process_index": self.processes.index, "cursor": self.cursor.state_dict(), "buffer_sha256": sha,
                "buffer_size": len(self.buffer)}

    def save(self, it: int, force: bool = False) -> None:
        """Checkpoint iteration `it` when it is due or `force` (collective: every process calls it).

        The replay buffer and the task cursor are the same on every process (the episodes are gathered before
        they enter the buffer, and every process walks the one cursor, see nlac_jax/parallel/distributed.py), so they are
        stored once, and every process's own record (index, cursor, buffer checksum) under loop_state['processes'];
        saving refuses processes whose copies differ. A run may so resume on another number of processes.
        The buffer goes in as segment files (rl.buffer_segments): the transitions and episodes added since the
        previous checkpoint are the one new file, the older segments are the earlier steps' files."""
        step, force = it + 1, force or it + 1 == self.loop.iterations
        if not self.checkpointer.due(step, force):
            return
        buffer_index, new_files = self.buffer.checkpoint(f"replay_buffer_step_{step:08d}.jsonl.gz")
        records = self.processes.allgather_objects(self._process_state(buffer_index))
        for r in records[1:]:  # every process holds every record, so all of them raise together
            for key in ("cursor", "buffer_sha256"):
                if r[key] != records[0][key]:
                    raise RuntimeError(f"checkpoint at iteration {it + 1}: process {r['process_index']}'s {key} "
                                       f"{r[key]!r} differs from process 0's {records[0][key]!r} (the processes "
                                       f"diverged)")
        loop_state = {"iteration": step, "buffer": buffer_index, "cursor": self.cursor.state_dict(),
                      "process_count": self.processes.count, "processes": records}
        files = {seg["name"]: seg["sha256"] for seg in buffer_index["segments"]}
        files.update(new_files)
        self.checkpointer.save(self.holder.state, metadata={"env": self.env_name, "iteration": step},
                               loop_state=loop_state, step=step, force=force, files=files)


def _close_after_error(r: "NLACRun", writer: "MetricsWriter | None") -> None:
    """On the error path: finish pending async checkpoint writes and release orbax's background work, so the
    error is the last thing the run reports (a failure while closing is logged, never raised over the error)."""
    for close in (r.checkpointer.close, writer.close if writer is not None else None):
        if close is None:
            continue
        try:
            close()
        except Exception as e:  # noqa: BLE001  the original error is the one to report
            log.warning("while closing after an error: %s: %s", type(e).__name__, " ".join(str(e).split())[:300])


class Preempted(Exception):
    """The run stopped early on SIGTERM, after saving iteration `iteration` (train.main exits EXIT_PREEMPTED)."""

    def __init__(self, iteration: int):
        super().__init__(f"stopped by SIGTERM after saving iteration {iteration}")
        self.iteration = iteration


def run(workdir: str) -> list[dict]:
    """Run (or resume) the gin-configured NLAC loop in `workdir` (local or gs://). Returns the metrics of this
    invocation ([] when the run had already finished every iteration: it says so in one line and builds nothing).
    One run per workdir: while this one runs, another started on `workdir` refuses at start-up (run_lock)."""
    lock = run_lock.acquire(workdir, Processes.current())  # decided on process 0, broadcast
    try:
        return _run(workdir)
    finally:
        lock.release()


def _run(workdir: str) -> list[dict]:
    """`run` once the workdir's lock is held."""
    import jax
    from tqdm import tqdm

    t_start = time.perf_counter()
    main_proc = jax.process_index() == 0  # process 0 alone writes logs, metrics, dumps, plots, exported files
    iterations = LoopConfig().iterations
    done = finished_iterations(workdir)
    if done is not None and done >= iterations:
        if main_proc:
            print(f"{fs.abspath(workdir)}: the run is finished ({done} of {iterations} iterations done); "
                  f"nothing to do (raise LoopConfig.iterations to continue it)")
        return []
    r = NLACRun(workdir)  # every start-up check passes before config.gin is (re)written
    r.stop = interrupts.StopRequest.install()
    writer, closed, preempted, bar = None, False, None, None
    try:
        if main_proc:
            write_config_gin(r.workdir)
        writer = MetricsWriter(r.workdir, r.start_iteration, enabled=main_proc)
        if main_proc:
            fs.makedirs(fs.join(r.workdir, "examples"))
        rows = []
        if r.loop.eval_before_training and r.start_iteration == 0:
            m0 = {"iteration": 0, **r.evaluate(-1)}
            writer.write(m0)
            rows.append(m0)
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
            # collective, every iteration: a SIGTERM on any process stops all of them here, after saving this one
            stop = it + 1 < r.loop.iterations and r.stop.agreed(r.processes)
            r.save(it, force=stop)
            if main_proc:
                fs.write_atomic(fs.join(r.workdir, "examples", f"iter_{it + 1:04d}.txt"), dump)
            writer.write(m)
            rows.append(m)
            if stop:
                preempted = it + 1
                break
        bar.close()
        r.checkpointer.wait()
        if r.loop.export_hf and preempted is None:
            # every process: gathering θ's shards is collective; hf_io writes on process 0 only
            training.export_hf(fs.join(r.workdir, "hf_export"), r.cfg, r.holder.state)
            if main_proc:
                hf_io.save_tokenizer(r.tokenizer, fs.join(r.workdir, "hf_export"))
        r.checkpointer.close()
        writer.close()
        closed = True
    finally:
        if bar is not None:  # before an error's one line: a bar left open redraws itself after it at exit
            bar.close()
        r.stop.uninstall()
        if not closed:
            _close_after_error(r, writer)
    if preempted is not None:
        if main_proc:
            print(f"{r.workdir}: stopped by SIGTERM after saving iteration {preempted} of {r.loop.iterations} "
                  f"(checkpoint step {preempted}); rerun the same command to resume", flush=True)
        raise Preempted(preempted)
    if main_proc and rows:
        print("\n" + summary_table(rows, eval_every=r.loop.eval_every))
        try:
            png = plots.plot_workdir(r.workdir)
            print(f"\nlearning curves: {png}")
        except Exception as e:  # plotting must never fail a finished run
            log.warning("plotting failed: %s", e)
        print(f"metrics: {writer.path}\nexamples: {fs.join(r.workdir, 'examples')}\n"
              f"wall time: {time.perf_counter() - t_start:.1f} s")
    return rows
