"""Warm start: supervised training on the scripted corpus with the project's own train step, saved as an HF dir.

    cfg, tok, _ = building.build_model(dtype="bfloat16", hidden_size=128, num_layers=4, ...)
    examples = corpus.toy_corpus(100, 400, seed=0)
    state = train_warm_start(cfg, tok, examples, steps=300, batch_size=16, learning_rate=3e-3, seed=0, max_len=768)
    save_warm_start(state, cfg, tok, "runs/warm_toy")        # config.json + safetensors + tokenizer files
    # NLAC then starts from it: build_model.model_dir = "runs/warm_toy" (loop.NLACRun loads θ = θ̄ from it)

Batches hold examples of one length bucket (``padded_length``: powers of two, or multiples of ``bucket_multiple``), so
padding stays small and the jitted step
compiles once per bucket. Every choice (shuffle, bucket order) is a function of ``seed``. The train step's L1 is
the successor/backup loss and L2 the policy/evaluator/refiner loss; :func:`role_losses` splits them per role.

:func:`evaluate_toy_warm_start` measures what the warm start can do per role on HELD-OUT states (test tasks):
evaluator verdict accuracy against the env's exact rule, refiner agreement with the scripted refinement,
successor/backup return accuracy, and the policy's success rate when it plays the game greedily.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any, Optional, Sequence

import numpy as np
from nlac_jax import models, sampling, text, training
from nlac_jax.envs.base import BatchedRunner
from nlac_jax.envs.toy import GuessNumberEnv, GuessNumberTaskSource
from nlac_jax.experiments import corpus
from nlac_jax.models import hf_io
from nlac_jax.models.decoder import CausalLM
from nlac_jax.nlac.prompts import PromptSet
from nlac_jax.nlac.verdict import clean_action, parse_outcome, parse_verdict
from nlac_jax.parallel import sharding
from nlac_jax.runner.building import build_model
from nlac_jax.training import batching, loss as loss_lib

log = logging.getLogger("nlac_jax.experiments.warm_start")

__all__ = [
    "encode_examples",
    "bucketed_batches",
    "train_warm_start",
    "role_losses",
    "save_warm_start",
    "load_warm_start",
    "generate_texts",
    "evaluate_toy_warm_start",
    "main",
]

WARM_START_META = "warm_start.json"


def _training_dict(e: Any) -> dict:
    return e.to_training_dict() if hasattr(e, "to_training_dict") else dict(e)


def _role(e: Any) -> str:
    return getattr(e, "role", None) or (e.get("role") if isinstance(e, dict) else None) or "all"


def encode_examples(tokenizer, examples: Sequence[Any], max_len: int) -> tuple[list, list[str], int]:
    """(batching.Examples, their roles, number dropped): chat_example per corpus example; examples whose prompt +
    target exceed ``max_len`` are DROPPED (a left-truncated prompt would lose the game's rules)."""
    out, roles, dropped = [], [], 0
    for e in examples:
        ex = batching.chat_example(tokenizer, **_training_dict(e))
        if len(ex.prompt_ids) + len(ex.target_ids) > max_len:
            dropped += 1
            continue
        out.append(ex)
        roles.append(_role(e))
    return out, roles, dropped


def padded_length(n: int, max_len: int, multiple: Optional[int] = None) -> int:
    """The row length a batch of examples of length ``n`` is padded to: ``text.bucket_length`` (powers of two),
    or, with ``multiple``, ``n`` rounded up to a multiple of it (finer buckets: less padding, more compiles)."""
    if multiple is None:
        return text.bucket_length(int(n), 16, max_len)
    if n > max_len:
        raise ValueError(f"length {n} exceeds the maximum {max_len}")
    return min(max_len, -(-int(n) // multiple) * multiple)


def bucketed_batches(lengths: Sequence[int], batch_size: int, rng: np.random.Generator, max_len: int,
                     multiple: Optional[int] = None):
    """Endless iterator of (padded length, index list): each epoch shuffles, groups indices by
    :func:`padded_length` and cuts each group into batches of ``batch_size`` (a group's last partial batch is
    topped up from the same group), then shuffles the batch order."""
    if not lengths:
        raise ValueError("bucketed_batches needs at least one example")
    while True:
        groups: dict[int, list[int]] = {}
        for i in rng.permutation(len(lengths)):
            groups.setdefault(padded_length(int(lengths[i]), max_len, multiple), []).append(int(i))
        batches = []
        for width, idx in sorted(groups.items()):
            for s in range(0, len(idx), batch_size):
                b = idx[s:s + batch_size]
                if len(b) < batch_size:  # top up so every batch is full (no zero-weight rows wasting compute)
                    b = b + [idx[j % len(idx)] for j in range(batch_size - len(b))]
                batches.append((width, b))
        for j in rng.permutation(len(batches)):
            yield batches[j]


def _eval_loss_fn(cfg):
    """Jitted (params, ids, positions, mask, loss_mask) -> per-row mean target-token NLL."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def fn(params, ids, positions, mask, loss_mask):
        hidden, _ = CausalLM(cfg).apply({"params": params}, ids, positions, mask, return_hidden=True)
        labels, tmask = loss_lib.shift_targets(ids, loss_mask)
        nll = loss_lib.token_nll(cfg, hidden, params, labels)
        return (nll * tmask).sum(1) / jnp.maximum(tmask.sum(1), 1.0)
    return fn


_EVAL_LOSS_FNS: dict = {}  # ModelConfig -> jitted eval-loss function (one compile per model, not per call)


def role_losses(cfg, params, tokenizer, examples: Sequence[Any], max_len: int,
                batch_size: int = 16) -> dict[str, float]:
    """Mean per-example target NLL (nats/token) per role on ``examples`` (no gradient)."""
    import jax
    encoded, roles, _ = encode_examples(tokenizer, examples, max_len)
    if not encoded:
        return {}
    if cfg not in _EVAL_LOSS_FNS:
        _EVAL_LOSS_FNS[cfg] = _eval_loss_fn(cfg)
    fn = _EVAL_LOSS_FNS[cfg]
    pad = tokenizer.pad_token_id or 0
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].prompt_ids) + len(encoded[i].target_ids))
    per_example = np.zeros(len(encoded))
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        b = batching.pack_examples([encoded[i] for i in idx], max_len, pad_id=pad, batch_size=batch_size)
        v = np.asarray(jax.device_get(fn(params, b.input_ids, b.positions, b.attention_mask, b.loss_mask)))
        per_example[idx] = v[:len(idx)]
    out: dict[str, list] = {}
    for r, v in zip(roles, per_example):
        out.setdefault(r, []).append(float(v))
    return {r: float(np.mean(v)) for r, v in sorted(out.items())}


def train_warm_start(model_cfg, tokenizer, examples: Sequence[Any], steps: int, batch_size: int,
                     learning_rate: float, seed: int, max_len: int, mesh=None, *, params=None,
                     warmup_steps: Optional[int] = None, end_lr_ratio: float = 0.1, weight_decay: float = 0.0,
                     normalisation: str = "sequence", log_every: int = 50, eval_examples: Sequence[Any] = (),
                     history: Optional[list] = None, bucket_multiple: Optional[int] = None,
                     on_record=None):
    """Supervised warm start: ``steps`` updates of the project's NLAC train step over ``examples`` (corpus
    examples or dicts with prompt_messages/target_text/kind/weight), bucketed by length and shuffled from
    ``seed``; cosine schedule with warmup (default 5% of the steps). Returns the TrainState.

    params: start from these (default: a random init from ``seed``). mesh: default ``sharding.make_mesh()``.
    normalisation: the step's loss normalisation. Default 'sequence' (every example counts equally): with 'token',
      the ~65-token critiques drown the 2-3-token actions of the policy and refiner examples in L2.
    Every ``log_every`` steps (and at the end) the mean train L1/L2 since the last log is logged, plus, when
    ``eval_examples`` are given, the per-role held-out loss; each record is appended to ``history``.
    bucket_multiple: pad each batch to its length rounded up to this multiple (default: powers of two). On the
      toy corpus, multiples of 32 cut the padded tokens by about a third for a few more compilations.
    on_record: called with each logged record (e.g. to write the progress of a long warm start to a file).
    """
    import jax
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    mesh = mesh if mesh is not None else sharding.make_mesh()
    warmup = max(1, steps // 20) if warmup_steps is None else int(warmup_steps)
    schedule = training.make_schedule(learning_rate, warmup_steps=warmup,
                                      decay="cosine" if steps > warmup else "constant",
                                      total_steps=steps, end_lr_ratio=end_lr_ratio)
    optimizer = training.make_optimizer(schedule, weight_decay=weight_decay)
    step_fn = training.make_train_step(model_cfg, mesh, optimizer, normalisation=normalisation)
    state = training.create_train_state(model_cfg, mesh, optimizer, params=params, seed=seed)

    encoded, _, dropped = encode_examples(tokenizer, examples, max_len)
    if dropped:
        log.warning("warm start: dropped %d of %d examples longer than max_len=%d", dropped, len(examples), max_len)
    if not encoded:
        raise ValueError("no training example fits max_len")
    lengths = [len(e.prompt_ids) + len(e.target_ids) for e in encoded]
    batches = bucketed_batches(lengths, batch_size, np.random.default_rng([seed, 1]), max_len, bucket_multiple)
    pad = tokenizer.pad_token_id or 0
    acc: dict[str, list] = {}
    t0 = last = time.perf_counter()
    tokens = 0
    for i in range(steps):
        width, idx = next(batches)
        batch = batching.pack_examples([encoded[j] for j in idx], max_len, pad_to=width, pad_id=pad)
        tokens += int(batch.attention_mask.sum())
        state, metrics = step_fn(state, batch)
        acc.setdefault("pending", []).append(metrics)
        if (i + 1) % log_every == 0 or i + 1 == steps:
            ms = jax.device_get(acc.pop("pending"))
            rec = {"step": i + 1, "seconds": time.perf_counter() - t0,
                   "tokens_per_s": tokens / max(time.perf_counter() - last, 1e-9)}
            for k in ("loss", "l1", "l2", "grad_norm", "learning_rate"):
                vals = [float(m[k]) for m in ms if k in m]
                if k in ("l1", "l2"):  # a batch without that kind reports 0 for it: average where present
                    kind_n = "critic_examples" if k == "l1" else "policy_examples"
                    vals = [float(m[k]) for m in ms if float(m[kind_n]) > 0]
                rec[f"train/{k}"] = float(np.mean(vals)) if vals else math.nan
            if eval_examples:
                rec.update({f"eval_loss/{r}": v for r, v in
                            role_losses(model_cfg, state.params, tokenizer, eval_examples, max_len).items()})
            log.info("warm start %s", " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                               for k, v in rec.items()))
            if history is not None:
                history.append(rec)
            if on_record is not None:
                on_record(rec)
            tokens, last = 0, time.perf_counter()
    step_fn.check()
    return state


def save_warm_start(state, cfg, tokenizer, directory: str, metadata: Optional[dict] = None) -> str:
    """Write θ as an HF directory (config.json + safetensors via ``training.export_hf``), the tokenizer (with its
    chat template) and ``warm_start.json`` (``metadata``). ``building.build_model(model_dir=directory)`` loads it."""
    os.makedirs(directory, exist_ok=True)
    training.export_hf(directory, cfg, state, which="params")
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json, where text.load_tokenizer reads it
    tokenizer.save_pretrained(directory, save_jinja_files=False)
    with open(os.path.join(directory, WARM_START_META), "w", encoding="utf-8") as f:
        json.dump(metadata or {}, f, indent=2, default=str)
        f.write("\n")
    return directory


def load_warm_start(directory: str, dtype: str = "float32", mesh=None) -> tuple:
    """(ModelConfig, tokenizer, params) from a :func:`save_warm_start` directory, through ``building.build_model``
    (exactly how NLACRun reads ``build_model.model_dir``)."""
    cfg, tok, _ = build_model(model_dir=directory, dtype=dtype, param_dtype="float32")
    shardings = models.param_shardings(cfg, mesh) if mesh is not None else None
    return cfg, tok, hf_io.load_params(directory, cfg, shardings)


# ----------------------------------------------------------------------------------------- evaluation


def generate_texts(cfg, params, tokenizer, prompts: Sequence[list], max_new_tokens: int, batch: int = 64,
                   sampler=None) -> list[str]:
    """Greedy completions of chat prompts (the role prompt messages), in order."""
    sampler = sampler or sampling.get_sampler(cfg)
    ids = [text.encode_chat(tokenizer, p, add_generation_prompt=True) for p in prompts]
    out: list[str] = []
    for s in range(0, len(ids), batch):
        res = sampler.generate(params, ids[s:s + batch], max_new_tokens=max_new_tokens, temperature=0.0,
                               tokenizer=tokenizer)
        out.extend(res.texts)
    return out


_EVAL_TOKENS = {"policy": 8, "refiner": 8, "evaluator": 80, "successor": 100, "backup": 100}


def evaluate_toy_warm_start(cfg, params, tokenizer, eval_examples: Sequence[Any], n: int,
                            policy_tasks: Sequence[Any] = (), max_turns: Optional[int] = None,
                            per_role: int = 64, seed: int = 0) -> dict:
    """Greedy per-role quality on held-out corpus examples (``corpus.toy_eval_corpus``):

    evaluator: verdict parse rate, accuracy vs the env rule (``meta['verdict']``), exact critique match;
    refiner: exact match with the scripted refinement, fraction optimal per the env rule;
    successor / backup: outcome parse rate, return accuracy vs the real return-to-go, exact match;
    policy: per-state optimal-move rate; with ``policy_tasks``, the greedy policy's success rate when it plays.
    """
    tasks_by_id = {t.id: t for t in GuessNumberTaskSource(n).tasks("all")}
    judges: dict = {}

    def judge(e):
        if e.task_id not in judges:  # optimality depends on the hidden number: reset a judge to the task
            judges[e.task_id] = GuessNumberEnv(n=n, max_turns=max_turns)
            judges[e.task_id].reset(tasks_by_id[e.task_id])
        return judges[e.task_id]

    rng = np.random.default_rng(seed)
    out: dict = {}
    by_role: dict[str, list] = {}
    for e in eval_examples:
        by_role.setdefault(e.role, []).append(e)
    for role, exs in sorted(by_role.items()):
        if len(exs) > per_role:
            exs = [exs[i] for i in sorted(rng.choice(len(exs), per_role, replace=False))]
        gens = generate_texts(cfg, params, tokenizer, [e.prompt_messages for e in exs], _EVAL_TOKENS.get(role, 64))
        out[f"{role}/n"] = len(exs)
        out[f"{role}/exact"] = float(np.mean([g.strip() == e.target_text.strip() for g, e in zip(gens, exs)]))
        if role == "evaluator":
            v = [parse_verdict(g) for g in gens]
            ok = [(p, e.meta["verdict"]) for p, e in zip(v, exs) if p is not None]
            out["evaluator/parse_rate"] = len(ok) / len(exs)
            out["evaluator/verdict_accuracy"] = float(np.mean([p == t for p, t in ok])) if ok else math.nan
            out["evaluator/truly_optimal"] = float(np.mean([e.meta["verdict"] for e in exs]))
        elif role in ("refiner", "policy"):
            acts = [clean_action(g) for g in gens]
            out[f"{role}/frac_optimal"] = float(np.mean([bool(judge(e).is_action_optimal(e.state, a))
                                                         for a, e in zip(acts, exs)]))
        elif role in ("successor", "backup"):
            parsed = [parse_outcome(g) for g in gens]
            out[f"{role}/parse_rate"] = float(np.mean([r is not None for _, r in parsed]))
            out[f"{role}/return_accuracy"] = float(np.mean([r is not None and abs(r - e.meta["return_to_go"]) < 1e-6
                                                            for (_, r), e in zip(parsed, exs)]))
        for i in range(min(2, len(exs))):
            out[f"{role}/sample{i}"] = {"target": exs[i].target_text, "generated": gens[i]}
    if policy_tasks:
        ps = PromptSet(task="toy")

        def policy_fn(histories):  # one batched greedy call per turn for all running games
            return [clean_action(g) for g in generate_texts(cfg, params, tokenizer, [ps.policy(h) for h in histories],
                                                            _EVAL_TOKENS["policy"])]
        envs = [GuessNumberEnv(n=n, max_turns=max_turns) for _ in policy_tasks]
        episodes = BatchedRunner(envs, policy_fn).run(list(policy_tasks))
        out["policy/play_success_rate"] = float(np.mean([ep.success for ep in episodes]))
        out["policy/play_episodes"] = len(episodes)
        out["policy/play_mean_length"] = float(np.mean([ep.length for ep in episodes]))
    return out


# ----------------------------------------------------------------------------------------- CLI


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Build the toy corpus, train a warm start, measure it per role, optionally save it. Prints a JSON report."""
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--test_every", type=int, default=5, help="every k-th number is a held-out task")
    p.add_argument("--episodes", type=int, default=300)
    p.add_argument("--eval_episodes", type=int, default=20)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--learning_rate", type=float, default=3e-3)
    p.add_argument("--max_len", type=int, default=768)
    p.add_argument("--hidden_size", type=int, default=128)
    p.add_argument("--num_layers", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--normalisation", default="sequence", choices=("token", "sequence"))
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--per_role", type=int, default=48)
    p.add_argument("--play_tasks", type=int, default=20)
    p.add_argument("--out", default=None, help="save the warm start here (HF directory)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    import jax

    t0 = time.perf_counter()
    source = GuessNumberTaskSource(args.n, test_every=args.test_every)
    train = corpus.toy_corpus(args.n, args.episodes, args.seed, task_source=source)
    held = corpus.toy_eval_corpus(args.n, args.eval_episodes, args.seed + 1, task_source=source)
    t_corpus = time.perf_counter() - t0
    heads = max(1, args.hidden_size // 32)
    cfg, tok, _ = build_model(dtype=args.dtype, hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
                              num_layers=args.num_layers, num_heads=heads, num_kv_heads=max(1, heads // 2),
                              head_dim=32)
    loss_probe = [held[i] for i in np.random.default_rng(0).choice(len(held), min(80, len(held)), replace=False)]
    history: list = []
    t1 = time.perf_counter()
    state = train_warm_start(cfg, tok, train, args.steps, args.batch_size, args.learning_rate, args.seed,
                             args.max_len, normalisation=args.normalisation, log_every=args.log_every,
                             eval_examples=loss_probe, history=history)
    t_train = time.perf_counter() - t1
    n_params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(state.params)))
    t2 = time.perf_counter()
    test_tasks = source.tasks("test")[: args.play_tasks]
    quality = evaluate_toy_warm_start(cfg, state.params, tok, held, args.n, policy_tasks=test_tasks,
                                      per_role=args.per_role, seed=args.seed)
    t_eval = time.perf_counter() - t2
    report = {"args": vars(args), "params": n_params, "corpus": corpus.corpus_stats(train),
              "held_out_examples": len(held), "seconds": {"corpus": t_corpus, "train": t_train, "eval": t_eval},
              "history": history, "quality": quality,
              "reference": corpus.reference_success_rates(args.n, test_tasks, args.seed)}
    if args.out:
        save_warm_start(state, cfg, tok, args.out, metadata={k: v for k, v in report.items() if k != "quality"})
    print(json.dumps(report, indent=1, default=str))
    return report


if __name__ == "__main__":
    main()
