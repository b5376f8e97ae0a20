"""Initial-state prompt lengths per task and role, and the gin/runs max_len values they do not fit.

    python benchmarks/prompt_lengths.py                          # the tiny in-process tokenizer (no downloads)
    python benchmarks/prompt_lengths.py --model_dir /path/to/Qwen2.5-7B-Instruct

For each task: the first --tasks tasks of the train and eval splits are reset (scripted oracle / user: no model
calls), every role prompt is rendered for the initial state with the short dummy texts of the loop's start-up check
(`nlac_jax.runner.loop.initial_role_prompts`), and the largest rendered chat (characters) and its token count are
printed.
This is exactly the part of a prompt that fitting can never elide (system prompt + first user message).

Then each gin/runs/*.gin is read (its LoopConfig.max_len, nlac.RoleSampling.max_new_tokens and task include) and
checked like the loop's start-up check: a role needs prompt tokens + the longest target it is trained on + 1.
Counts are for the given tokenizer: the tiny one has few merges, so it spends far more tokens per character than
a real model's (Qwen2.5: about 3.5-4 characters per token on English text).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

TASKS = ("toy", "twenty_questions", "math", "tau_retail", "tau_airline")


def measure(task: str, tokenizer, n_tasks: int) -> dict[str, tuple[int, int]]:
    """role -> (characters, tokens) of the largest initial prompt over the first n_tasks tasks of each split."""
    from nlac_jax import envs, text
    from nlac_jax.nlac import prompts as prompts_lib
    from nlac_jax.runner import loop
    source = envs.make_task_source(env_name=task)
    states = loop.initial_states(envs.EnvFactory(task), source, n_tasks)
    ps = prompts_lib.PromptSet(task=task)
    out: dict[str, tuple[int, int]] = {}
    for _, state in states:
        for role, messages in loop.initial_role_prompts(ps, state).items():
            rendered = text.render_chat(tokenizer, messages, add_generation_prompt=True)
            cur = (len(rendered), len(text.encode_text(tokenizer, rendered)))
            out[role] = max(out.get(role, (0, 0)), cur, key=lambda x: x[1])
    return out


def read_run_file(path: str) -> dict:
    """The values the check needs from a run gin file (plain regexes: the 7B files need MODEL_DIR for gin)."""
    from nlac_jax.rl.roles import RoleSampling
    src = open(path, encoding="utf-8").read()
    task = re.search(r"include\s+'gin/tasks/(\w+)\.gin'", src)
    max_len = re.search(r"^LoopConfig\.max_len\s*=\s*(\d+)", src, re.MULTILINE)
    mnt = re.search(r"^nlac\.RoleSampling\.max_new_tokens\s*=\s*(\{[^}]*\})", src, re.MULTILINE)
    return {
        "task": task.group(1) if task else None,
        "max_len": int(max_len.group(1)) if max_len else None,
        "max_new_tokens": ast.literal_eval(mnt.group(1)) if mnt else RoleSampling().max_new_tokens,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model_dir", default=None, help="HF directory whose tokenizer to use (default: tiny tokenizer)")
    p.add_argument("--tasks", type=int, default=4, help="tasks per split to reset (default 4)")
    p.add_argument("--only", nargs="*", default=list(TASKS), help="tasks to measure")
    p.add_argument("--estimate_chars_per_token", type=float, default=3.0,
                   help="with the tiny tokenizer, also check the run files at this many characters per token "
                        "(default 3.0: a pessimistic figure for Qwen2.5 on English + JSON)")
    args = p.parse_args(argv)

    from nlac_jax import text
    from nlac_jax.nlac import prompts as prompts_lib
    from nlac_jax.testing import tiny
    if args.model_dir:
        tok, tok_name = text.load_tokenizer(args.model_dir), args.model_dir
    else:
        tok = tiny.make_tiny_tokenizer()
        tok_name = "tiny in-process tokenizer (nlac_jax.testing.tiny; NOT a real model's)"

    lengths: dict[str, dict] = {}
    for task in args.only:
        try:
            lengths[task] = measure(task, tok, args.tasks)
        except ImportError as e:  # τ-bench needs requirements-envs.txt
            print(f"# {task}: skipped ({e})")
    print(f"# initial-state prompt lengths, tokenizer: {tok_name}")
    print(f"{'task':<18} {'role':<10} {'chars':>7} {'tokens':>7} {'chars/tok':>9}")
    for task, roles in lengths.items():
        for role, (chars, toks) in roles.items():
            print(f"{task:<18} {role:<10} {chars:>7} {toks:>7} {chars / max(toks, 1):>9.2f}")

    print("\n# gin/runs max_len check (prompt tokens + longest target + 1 <= max_len, per role)")
    runs = os.path.join(REPO, "gin", "runs")
    for name in sorted(os.listdir(runs)):
        if not name.endswith(".gin"):
            continue
        r = read_run_file(os.path.join(runs, name))
        if r["task"] not in lengths or r["max_len"] is None:
            print(f"{name}: task {r['task']!r} not measured or no max_len; skipped")
            continue
        budgets = prompts_lib.prompt_budgets(r["max_len"], r["max_new_tokens"])
        counts = {"measured": {role: toks for role, (_, toks) in lengths[r["task"]].items()}}
        if not args.model_dir:
            cpt = args.estimate_chars_per_token
            counts[f"at {cpt:g} chars/token"] = {role: int(chars / cpt + 0.5)
                                                 for role, (chars, _) in lengths[r["task"]].items()}
        for how, toks in counts.items():
            need = {role: n + r["max_len"] - budgets[role] for role, n in toks.items()}
            worst = max(need, key=need.get)
            ok = need[worst] <= r["max_len"]
            print(f"{name}: task {r['task']}, max_len {r['max_len']}, {how}: needs {need[worst]} ({worst}) -> "
                  f"{'fits' if ok else 'TOO SMALL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
