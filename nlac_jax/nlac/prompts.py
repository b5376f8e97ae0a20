"""The ONE prompt registry for NLAC's roles.

One LLM plays every role; the role is selected by its prompt (design §1). Each role's prompt is a jinja2
template file ``templates/<set>/<role>.txt`` rendered with ``StrictUndefined`` (a missing field raises instead
of silently rendering an empty string). Roles:

==================  ===========================================  =========================================
role                function                                      returns
==================  ===========================================  =========================================
policy              ``policy(state)``                             the state messages (+ optional hint)
successor           ``successor(state, action)``                  chat messages → forecast ending in
                                                                  ``Outcome: ...; Return: ...``
backup              ``backup(state, action, reward, obs,          chat messages → merged forecast d*_t
                    next_action, next_future, target=None)``
evaluator           ``evaluator(state, action, futures)``         chat messages → critique ending in
                                                                  ``Verdict: optimal|suboptimal``
refiner             ``refiner(state, action, critique, prev)``    chat messages → the refined action only
terminal_summary    ``terminal_summary(reward, ret, success)``    the target TEXT itself (no model call)
==================  ===========================================  =========================================

Template files may contain section lines ``=== system ===`` / ``=== user ===`` / ``=== assistant ===``; each
section becomes one chat message (sections that render empty are dropped). A file without section lines is a
single user message. Sections are split BEFORE rendering, so transcripts that happen to contain such lines
cannot inject messages. ``terminal_summary`` renders plain text (no sections); a ``policy`` template without
sections is a system hint, with sections it replaces the state messages (see ``PromptSet.policy``). Templates
may ``{% include "<set>/<file>" %}`` shared pieces from the packaged template root.

Prompt sets: ``PromptSet(task='twenty_questions')`` looks for each role in ``templates/twenty_questions/``
first and falls back to ``templates/default/``. Extra template roots (``template_dirs``) are searched before
the packaged one. Per-role overrides (a file path or a template string) come from arguments or gin::

    nlac.PromptSet.overrides = {'evaluator': 'prompts/strict_evaluator.txt'}
    nlac.PromptSet.task_overrides = {'math': {'refiner': 'Solve again: {{ transcript }}'}}
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import gin
import jinja2

from nlac_jax.envs.twenty_questions_state import public_state as twenty_questions_public_state
from nlac_jax.nlac.verdict import (format_return, leading_outcome_line, outcome_line, parse_outcome,
                                  replace_outcome_line)
from nlac_jax.rl.roles import CHAT_ROLES

__all__ = [
    "ROLES",
    "CHAT_ROLES",
    "DEFAULT_SET",
    "TEMPLATE_ROOT",
    "PromptSet",
    "PromptTemplate",
    "get_prompt_set",
    "available_prompt_sets",
    "render_transcript",
    "prompt_budgets",
    "TARGET_ROLES",
]

# Roles whose prompt is sent to the model (CHAT_ROLES: the RoleSampler's role names, defined with the sampling
# settings keyed by them in nlac_jax.rl.roles), then the text-only one.
ROLES = CHAT_ROLES + ("terminal_summary",)
DEFAULT_SET = "default"
TEMPLATE_ROOT = Path(__file__).resolve().parent / "templates"
# Env names that share one template folder (looked up after a folder named exactly like the task).
TASK_FOLDER_ALIASES = {"tau_retail": "tau_bench", "tau_airline": "tau_bench"}

_SECTION_RE = re.compile(r"^===\s*(system|user|assistant)\s*===\s*$", re.MULTILINE)
_TEXT_ONLY_ROLES = ("terminal_summary",)

_JINJA = jinja2.Environment(
    # `{% include '<set>/<file>' %}` reads shared pieces from the packaged template root (e.g.
    # toy_compact/_state.txt, one rendering of the state for every role of a set).
    loader=jinja2.FileSystemLoader(str(TEMPLATE_ROOT)),
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=False,
    autoescape=False,
)
_JINJA.filters["num"] = format_return
# The compact 20 Questions state (templates/twenty_questions_forecast/_state.txt): history items, the objects still
# possible and the questions left, computed from the transcript and the world's object table. Public information
# (the table is the game's world, named in the system message), rendered by one line that every role and the policy
# read. A function of envs/ (layer 4) registered here (nlac/, layer 6, may import it): Jinja cannot load a table.
_JINJA.globals["twenty_questions_state"] = twenty_questions_public_state

# ------------------------------------------------------------------------------------------ transcripts

DEFAULT_LABELS = {"system": "SYSTEM", "user": "USER", "assistant": "AGENT", "tool": "TOOL"}


def _content_text(m: Mapping) -> str:
    content = m.get("content")
    if isinstance(content, list):  # content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    text = "" if content is None else str(content)
    if m.get("tool_calls"):
        calls = json.dumps(m["tool_calls"], ensure_ascii=False, default=str)
        text = f"{text}\n[tool calls] {calls}" if text else f"[tool calls] {calls}"
    return text.strip()


def render_transcript(
    messages: Sequence[Mapping] | None,
    labels: Mapping[str, str] | None = None,
    max_chars: int | None = None,
    empty: str = "(no messages)",
) -> str:
    """Renders chat messages as a readable transcript for the role prompts::

        [SYSTEM]
        You are playing 20 questions ...

        [USER]
        Ask your first question.

        [AGENT]
        Is it an animal?

    ``assistant`` messages are labelled AGENT (they are the policy's actions), ``user`` USER (the environment /
    user side), ``tool`` TOOL (with the tool name when given). ``max_chars`` keeps the END of the transcript (the
    recent turns matter most) and marks the cut; the default is the full transcript.
    """
    if not messages:
        return empty
    labels = {**DEFAULT_LABELS, **(labels or {})}
    blocks = []
    for m in messages:
        role = str(m.get("role", "user"))
        label = labels.get(role, role.upper())
        if role == "tool" and m.get("name"):
            label = f"{label} {m['name']}"
        blocks.append(f"[{label}]\n{_content_text(m)}")
    text = "\n\n".join(blocks)
    if max_chars is not None and len(text) > max_chars:
        text = "[... earlier turns omitted ...]\n" + text[len(text) - max_chars :]
    return text


# ------------------------------------------------------------------------------------------ templates


@dataclasses.dataclass(frozen=True)
class PromptTemplate:
    """A compiled role template: ``sections`` is a list of (chat role, jinja template)."""

    role: str
    source: str
    origin: str  # file path, or "<string>" for inline templates
    sections: tuple
    sectioned: bool = False  # the source has explicit ``=== <role> ===`` lines

    @classmethod
    def compile(cls, role: str, source: str, origin: str) -> "PromptTemplate":
        """Splits ``source`` into ``=== <chat role> ===`` sections and compiles each."""
        parts = _SECTION_RE.split(source)
        head, rest = parts[0], parts[1:]
        sections = []
        if not rest:
            sections.append(("user", _JINJA.from_string(head)))
        else:
            if _JINJA.from_string(head).render().strip():  # only comments may precede the first section
                raise ValueError(f"{origin}: text before the first '=== <role> ===' line")
            for chat_role, body in zip(rest[0::2], rest[1::2]):
                sections.append((chat_role, _JINJA.from_string(body)))
        if role in _TEXT_ONLY_ROLES and (len(sections) != 1 or rest):
            raise ValueError(f"{origin}: the {role!r} template renders plain text; remove the section lines")
        return cls(role=role, source=source, origin=origin, sections=tuple(sections), sectioned=bool(rest))

    def render_messages(self, **fields: Any) -> list[dict]:
        """Renders every section; raises ``jinja2.UndefinedError`` when a field the template uses is missing."""
        out = []
        for chat_role, tmpl in self.sections:
            text = tmpl.render(**fields).strip()
            if text:
                out.append({"role": chat_role, "content": text})
        if not out:
            raise ValueError(f"{self.origin}: the {self.role!r} prompt rendered empty")
        return out

    def render_text(self, **fields: Any) -> str:
        """Renders a single-section template to stripped text (may be empty)."""
        if len(self.sections) != 1:
            raise ValueError(f"{self.origin}: render_text needs a template without sections")
        return self.sections[0][1].render(**fields).strip()


def _looks_like_path(value: str) -> bool:
    return "\n" not in value and "{{" not in value and "{%" not in value and (
        value.endswith((".txt", ".j2", ".jinja", ".jinja2")) or os.sep in value
    )


def _compile_override(role: str, value: Any) -> PromptTemplate:
    """An override is a path (str/PathLike ending in .txt/.j2/... or containing a path separator) or a
    template string. A path that does not exist raises, rather than being used as literal prompt text."""
    if isinstance(value, os.PathLike) or (isinstance(value, str) and _looks_like_path(value)):
        path = Path(value)
        if not path.is_file():
            raise FileNotFoundError(f"prompt override for {role!r}: no such file {str(path)!r}")
        return PromptTemplate.compile(role, path.read_text(encoding="utf-8"), str(path))
    if not isinstance(value, str):
        raise TypeError(f"prompt override for {role!r} must be a path or a template string")
    return PromptTemplate.compile(role, value, "<string>")


def available_prompt_sets(template_dirs: Sequence[str | os.PathLike] = ()) -> list[str]:
    """Names of the prompt sets (sub-directories) in the template roots."""
    names = set()
    for root in [*map(Path, template_dirs), TEMPLATE_ROOT]:
        if root.is_dir():
            names.update(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
    return sorted(names)


def _check_roles(d: Mapping, what: str) -> None:
    unknown = set(d) - set(ROLES)
    if unknown:
        raise ValueError(f"{what}: unknown roles {sorted(unknown)}; roles are {list(ROLES)}")


# ------------------------------------------------------------------------------------------ prompt budgets

# The roles whose generations can be the training target (or the generation) of each role's prompt: the policy
# prompt is trained on refinements, the successor prompt on d* (a backup, or a successor forecast as fallback).
TARGET_ROLES = {
    "policy": ("policy", "refiner"),
    "successor": ("successor", "backup"),
    "backup": ("backup",),
    "evaluator": ("evaluator",),
    "refiner": ("refiner",),
}


def prompt_budgets(max_len: int, max_new_tokens: Mapping[str, int]) -> dict[str, int]:
    """Per-role prompt token budgets for ``text.PromptFitter``: ``max_len`` minus the longest target the role's
    prompt is sampled with or trained on (``TARGET_ROLES``), minus 1 for the turn-end token training appends.

    ``max_new_tokens``: role -> generation budget (``nlac.RoleSampling.max_new_tokens``; missing roles use the
    ``'policy'`` entry, as the sampler does). Budgets may be < 1; ``PromptFitter`` refuses them.
    """
    def new(role: str) -> int:
        return int(max_new_tokens[role] if role in max_new_tokens else max_new_tokens["policy"])

    return {role: int(max_len) - max(new(r) for r in targets) - 1 for role, targets in TARGET_ROLES.items()}


@gin.configurable(module="nlac")
class PromptSet:
    """The prompts of all roles for one task family.

    Resolution order for each role: ``overrides[role]`` (argument or gin), then
    ``task_overrides[task][role]``, then ``<root>/<prompt_set>/<role>.txt`` (when given), then
    ``<root>/<task>/<role>.txt`` for each root in
    ``(*template_dirs, TEMPLATE_ROOT)``, then ``<root>/default/<role>.txt``. ``source(role)`` tells which won.

    Args:
      task: task family name (e.g. ``"twenty_questions"``); None means the default set.
      overrides: role -> template path or template string, for every task.
      task_overrides: task -> {role -> path or string}; applied when ``task`` matches.
      template_dirs: extra template roots searched before the packaged ``templates/``.
      transcript_labels: labels for :func:`render_transcript` (e.g. ``{'user': 'CUSTOMER'}``).
      max_transcript_chars: keep only the last N characters of long transcripts (None: full history).
      prompt_set: a template folder searched before the task's own (e.g. ``'toy_compact'``, the unit-scale
        experiment's short prompts); roles it lacks come from the task folder, then ``default``.

    ``fitter`` (attribute, default None; the loop sets a ``text.PromptFitter``): every chat role method passes its
    state through ``fitter.fit`` so that the rendered prompt fits the role's token budget. Acting (rollouts call
    ``policy``) and training (targets call ``policy`` / ``successor``) share this object, so a state always gets
    the same prompt in both.
    """

    def __init__(
        self,
        task: str | None = None,
        overrides: Mapping[str, Any] | None = None,
        task_overrides: Mapping[str, Mapping[str, Any]] | None = None,
        template_dirs: Sequence[str | os.PathLike] = (),
        transcript_labels: Mapping[str, str] | None = None,
        max_transcript_chars: int | None = None,
        prompt_set: str | None = None,
    ):
        self.task = task
        self.prompt_set = prompt_set
        self.template_dirs = tuple(Path(d) for d in template_dirs)
        self.transcript_labels = dict(transcript_labels or {})
        self.max_transcript_chars = max_transcript_chars
        self.fitter = None  # a text.PromptFitter, or None: no fitting (tests, tools)
        merged: dict[str, Any] = {}
        for t, d in (task_overrides or {}).items():
            _check_roles(d, f"task_overrides[{t!r}]")
            if t == task:
                merged.update(d)
        # Global overrides win over task-specific ones: they are the more explicit, run-level choice.
        _check_roles(overrides or {}, "overrides")
        merged.update(overrides or {})
        self._templates: dict[str, PromptTemplate] = {}
        for role in ROLES:
            if role in merged:
                self._templates[role] = _compile_override(role, merged[role])
            else:
                self._templates[role] = self._load_file(role)

    def _load_file(self, role: str) -> PromptTemplate:
        roots = [*self.template_dirs, TEMPLATE_ROOT]
        sets = [self.task] if self.task and self.task != DEFAULT_SET else []
        sets = ([self.prompt_set] if self.prompt_set else []) + sets
        sets += [TASK_FOLDER_ALIASES[t] for t in sets if t in TASK_FOLDER_ALIASES] + [DEFAULT_SET]
        for name in sets:
            for root in roots:
                path = root / name / f"{role}.txt"
                if path.is_file():
                    return PromptTemplate.compile(role, path.read_text(encoding="utf-8"), str(path))
        raise FileNotFoundError(f"no template for role {role!r} (task {self.task!r}) in {[str(r) for r in roots]}")

    def __repr__(self) -> str:
        return f"PromptSet(task={self.task!r})"

    def template(self, role: str) -> PromptTemplate:
        """The compiled template of ``role``."""
        return self._templates[role]

    def source(self, role: str) -> str:
        """Where the template of ``role`` came from (a path, or ``<string>``)."""
        return self._templates[role].origin

    def transcript(self, messages: Sequence[Mapping] | None) -> str:
        """:func:`render_transcript` with this set's labels and length limit."""
        return render_transcript(messages, self.transcript_labels, self.max_transcript_chars)

    def _common(self, state: Sequence[Mapping]) -> dict:
        """The fields every role template may read. ``system_message`` is the state's leading system message(s)
        verbatim and ``conversation`` the transcript of the messages after it: the packaged sets put the former
        first (as their own system message) and the latter right after it, before any role's instructions, so
        every role's prompt, the policy's included, starts with the same tokens and the sampler's prefix cache
        and the train step's prefix-tree packing compute them once. ``transcript`` is the whole transcript."""
        lead = 0
        while lead < len(state) and state[lead].get("role") == "system":
            lead += 1
        return {"transcript": self.transcript(state), "state_messages": [dict(m) for m in state], "task": self.task,
                "system_message": "\n\n".join(_content_text(m) for m in state[:lead]),
                "conversation": render_transcript(state[lead:], self.transcript_labels, self.max_transcript_chars,
                                                  empty="(no messages yet)")}

    def render(self, role: str, **fields: Any) -> list[dict]:
        """Renders ``role``'s template with exactly ``fields`` (no defaults); missing fields raise."""
        return self._templates[role].render_messages(**fields)

    def _fitted(self, role: str, state: Sequence[Mapping], render: Callable[[list], list[dict]]) -> list[dict]:
        """``render(state)``, or the fitter's version of it with middle messages of ``state`` elided."""
        if self.fitter is None:
            return render([dict(m) for m in state])
        return self.fitter.fit(role, [dict(m) for m in state], render, task=self.task)

    # --- the roles ----------------------------------------------------------------------------------------

    def policy(self, state: Sequence[Mapping]) -> list[dict]:
        """The policy prompt. By default the state messages themselves (copied), plus the policy template's text
        as a system hint when it renders non-empty (appended to the first system message, or a new one). A
        policy template with ``=== <role> ===`` lines instead REPLACES the messages with its rendering of the
        state (an observation function, e.g. templates/toy_compact/policy.txt)."""
        return self._fitted("policy", state, self._policy_messages)

    def _policy_messages(self, state: Sequence[Mapping]) -> list[dict]:
        if self._templates["policy"].sectioned:
            return self.render("policy", **self._common(state))
        messages = [dict(m) for m in state]
        hint = self._templates["policy"].render_text(**self._common(state))
        if hint:
            if messages and messages[0].get("role") == "system":
                messages[0]["content"] = f"{_content_text(messages[0])}\n\n{hint}"
            else:
                messages.insert(0, {"role": "system", "content": hint})
        return messages

    def successor(self, state: Sequence[Mapping], action: str) -> list[dict]:
        """M(s, a): asks for a forecast of the rest of the episode, ending ``Outcome: ...; Return: ...``."""
        return self._fitted("successor", state, lambda s: self.render("successor", action=action, **self._common(s)))

    def backup(
        self,
        state: Sequence[Mapping],
        action: str,
        reward: float,
        next_observation: str | Sequence[Mapping],
        next_action: str,
        next_future: str,
        target: tuple[bool, float] | None = None,
    ) -> list[dict]:
        """B_L: merge (r_t, environment response, a_{t+1}) with the forecast d_{t+1} into one summary d*_t.

        ``next_observation`` is the text or the messages the environment produced after ``action``.
        ``target = (success, return)`` fixes the final line the model is asked to write (the caller computes
        r_t + the forecast's return); None lets the model compute it.
        """
        if not isinstance(next_observation, str):
            next_observation = render_transcript(
                next_observation, self.transcript_labels, empty="(the environment sent no message)"
            )
        fields = dict(
            action=action,
            reward=format_return(reward),
            next_observation=next_observation,
            next_action=next_action,
            next_future=next_future,
            target_line=None if target is None else outcome_line(*target),
        )
        return self._fitted("backup", state, lambda s: self.render("backup", **fields, **self._common(s)))

    def evaluator(self, state: Sequence[Mapping], action: str, futures: Sequence[str]) -> list[dict]:
        """E(s, a, d¹..dᵏ): asks for a critique ending ``Verdict: optimal`` or ``Verdict: suboptimal``."""
        if isinstance(futures, str):
            futures = [futures]
        if not futures:
            raise ValueError("the evaluator needs at least one future summary")
        futures = list(futures)
        return self._fitted(
            "evaluator", state, lambda s: self.render("evaluator", action=action, futures=futures, **self._common(s))
        )

    def refiner(
        self, state: Sequence[Mapping], action: str, critique: str, previous_refinements: Sequence[str] = ()
    ) -> list[dict]:
        """π_r(s, a, Q_L, earlier refinements): asks for the improved action text only."""
        fields = dict(action=action, critique=critique, previous_refinements=list(previous_refinements))
        return self._fitted("refiner", state, lambda s: self.render("refiner", **fields, **self._common(s)))

    @property
    def outcome_first(self) -> bool:
        """Whether this set's summaries start with their Outcome line (read off its terminal summary: the format
        the successor is trained on), instead of ending with it."""
        if not hasattr(self, "_outcome_first"):
            self._outcome_first = leading_outcome_line(self.terminal_summary(1.0, 1.0, True, None)) is not None
        return self._outcome_first

    def terminal_summary(
        self, reward: float, episode_return: float, success: bool, final_observation: str | None = None
    ) -> str:
        """The target summary of a terminal transition (no model call). ``reward`` is r_t, which for the last
        step IS the return from the action on; the canonical ``Outcome: ...; Return: <reward>`` line is
        guaranteed to end the text even if a custom template forgets it."""
        line = outcome_line(bool(success), reward)
        text = self._templates["terminal_summary"].render_text(
            reward=format_return(reward),
            episode_return=format_return(episode_return),
            success=bool(success),
            outcome="success" if success else "failure",
            final_observation=final_observation or None,
            outcome_line=line,
        )
        if parse_outcome(text) != (bool(success), float(format_return(reward))):
            text = replace_outcome_line(text, bool(success), reward)
        return text

    def validate(self) -> None:
        """Renders every role with small example inputs; raises on template errors or missing fields."""
        state = [{"role": "system", "content": "Task."}, {"role": "user", "content": "Go."}]
        self.policy(state)
        self.successor(state, "act")
        self.backup(state, "act", 0.0, "obs", "next act", "future\nOutcome: success; Return: 1", (True, 1.0))
        self.backup(state, "act", 0.0, [], "next act", "future", None)
        self.evaluator(state, "act", ["future 1", "future 2"])
        self.refiner(state, "act", "critique", ["better act"])
        self.refiner(state, "act", "critique", [])
        self.terminal_summary(1.0, 1.0, True, "Correct!")
        self.terminal_summary(0.0, -3.0, False, None)


def get_prompt_set(task: str | None = None, **kwargs: Any) -> PromptSet:
    """``PromptSet(task=task, **kwargs)`` with gin bindings applied (not cached: gin bindings may change)."""
    return PromptSet(task=task, **kwargs)


PromptSetFactory = Callable[[str | None], PromptSet]
