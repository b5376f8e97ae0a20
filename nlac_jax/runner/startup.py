"""Start-up checks on prompt lengths: every role's initial prompt for the first tasks of each split, rendered and
fitted before any model is built, so a context too small for the system prompt and the task fails in one line."""

from __future__ import annotations
from nlac_jax import envs, text

STARTUP_TASKS = 4  # tasks per split whose initial state the start-up check renders

# Short stand-ins for the texts role prompts quote besides the state: the start-up check measures the part that
# cannot be elided (system prompt + task), and the real texts are bounded by TargetConfig's character limits.
_DUMMY = {"action": "I will proceed.", "next_observation": "OK.", "next_action": "I will continue.",
          "future": "The agent continues and finishes the task.\nOutcome: success; Return: 1",
          "critique": "The action is reasonable.\nVerdict: optimal"}


def initial_states(env_factory, task_source, n_tasks: int = STARTUP_TASKS) -> list[tuple[str, list]]:
    """(task id, initial state) for the first `n_tasks` tasks of the train and eval splits.

    The envs are built with the scripted oracle / user (whatever the run uses): resetting them costs no model call,
    and the scripted τ-bench user's first message (the scenario's reason for calling) stands in for the model's.
    """
    f = env_factory
    env = envs.EnvFactory(f.env_name, oracle="scripted", user="scripted", max_turns=f.max_turns,
                          object_list_path=f.object_list_path)()
    out, seen = [], set()
    for split in dict.fromkeys((task_source.train_split, task_source.eval_split)):
        for task in task_source.tasks(split)[:n_tasks]:
            if task.id not in seen:
                seen.add(task.id)
                out.append((task.id, env.reset(task)))
    return out


def initial_role_prompts(prompt_set, state: list) -> dict[str, list]:
    """Every chat role's prompt for `state` with short dummy action / future / critique texts (role -> messages)."""
    d = _DUMMY
    return {
        "policy": prompt_set.policy(state),
        "successor": prompt_set.successor(state, d["action"]),
        "backup": prompt_set.backup(state, d["action"], 0.0, d["next_observation"], d["next_action"], d["future"],
                                    (True, 1.0)),
        "evaluator": prompt_set.evaluator(state, d["action"], [d["future"]]),
        "refiner": prompt_set.refiner(state, d["action"], d["critique"], []),
    }


def check_initial_prompts(states: list[tuple[str, list]], prompt_set, fitter, task: str | None = None) -> dict:
    """Start-up check: every role's prompt for every initial state must fit its budget (`fitter.budgets`).

    Returns role -> the largest initial prompt in tokens. Raises ValueError (one line: task, task id, role, tokens
    needed, budget, max_len and the gin knob) when the part that can never be elided does not fit.
    """
    saved, prompt_set.fitter = prompt_set.fitter, None  # measure unfitted: the initial state has nothing to elide
    try:
        worst: dict[str, int] = {}
        for task_id, state in states:
            for role, messages in initial_role_prompts(prompt_set, state).items():
                n = fitter.count_tokens(messages)
                worst[role] = max(worst.get(role, 0), n)
                budget = fitter.budgets.get(role)
                if budget is not None and n > budget:
                    need = "" if fitter.max_len is None else f" (max_len >= {n + fitter.max_len - budget} needed)"
                    raise text.PromptTooLongError(
                        f"start-up check: task {task!r} (task id {task_id!r}): the initial {role!r} prompt (system "
                        f"prompt + first user message, which are never elided) needs {n} tokens, but "
                        f"LoopConfig.max_len={fitter.max_len} leaves {budget} for it after the longest target"
                        f"{need}; {fitter.hint}")
        return worst
    finally:
        prompt_set.fitter = saved
