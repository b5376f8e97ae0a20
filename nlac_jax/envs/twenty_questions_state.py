"""The PUBLIC state of a 20 Questions game: what every role and the policy may read.

A game's public state is its transcript plus the world (object table) it is played in. The world is public: the
system message of a game in a named world says so ("World: unit."), and the table is the game's rulebook, the same
for every role and the policy (they all read it through the same rendered line). From those two:

* ``answer_word`` (defined in ``twenty_questions``): the oracle's reply as one word: yes / no / can't answer /
  correct / error;
* ``candidates`` (defined in ``twenty_questions``, whose action categories read it): the objects consistent with every (question, answer) pair of the transcript, and the questions
  asked. An attribute or category question answered yes / no keeps the objects with / without it; "I can't answer
  that." (an unanswerable or refused question) keeps everyone; a guess answered "No." drops the objects it names.
  The classification of a question mirrors ``ScriptedOracle.answer`` (attribute, then category, then guess);
* ``dominated_question``: an action the public state already shows useless (for ``nlac.TargetConfig.target_filter``);
* ``even_splits``: the unasked attributes that split the still-possible objects most evenly (a count over the
  public table, which the policy could make itself);
* ``public_state``: history items ("alive? yes"), candidate names, questions left and, when
  ``state_lines.show_even_splits`` is on, the even splits: what the compact prompts
  (``nlac/templates/twenty_questions_forecast/_state.txt``) render.

Nothing here reads the hidden object or the oracle's hidden refusal rule: only the transcript and the table.
"""

from __future__ import annotations

import functools
import re
from typing import Optional, Sequence

# answer_word and candidates live in the env module (its action categories read them); exported here too
import gin

from nlac_jax.envs.twenty_questions import (ANSWER_WORDS, MAX_QUESTIONS, ObjectTable, answer_word, candidates,
                                            canonical_question, load_object_table, public_category)

__all__ = ["ANSWER_WORDS", "answer_word", "world_of", "table_of_world", "candidates", "public_state",
           "dominated_question", "attribute_order", "asked_attributes", "even_splits", "state_lines"]

_WORLD_RE = re.compile(r"\bWorld: ([A-Za-z0-9_\-]+)\.")
_MAX_RE = re.compile(r"You have at most (\d+) questions")
SHORT_ACTION_CHARS = 24  # a history item shows at most this much of an action (a garbled one is long)


def world_of(state_messages: Sequence[dict]) -> str:
    """The world named by the state's system message ("World: unit." -> 'unit'); 'scripted' (the default table)
    when it names none."""
    for m in state_messages:
        if m.get("role") == "system":
            found = _WORLD_RE.search(str(m.get("content", "")))
            if found:
                return found.group(1)
    return "scripted"


@functools.lru_cache(maxsize=8)
def table_of_world(world: str) -> ObjectTable:
    """The object table of a named world (``OBJECT_SETS``), loaded once per process: prompts are rendered
    thousands of times per iteration."""
    return load_object_table(world)


def _short(action: str) -> str:
    text = " ".join(str(action).split())
    return text[:SHORT_ACTION_CHARS] or "(empty)"


def attribute_order(table: ObjectTable) -> tuple[str, ...]:
    """The table's attributes in its (public, fixed) order."""
    return tuple(dict.fromkeys(table.attribute_questions.values()))


def asked_attributes(state_messages: Sequence[dict], table: ObjectTable) -> set:
    """The attributes the agent's messages have asked about (either phrasing), answered or not."""
    return {a for a in (table.attribute_questions.get(canonical_question(str(m.get("content", ""))))
                        for m in state_messages if m.get("role") == "assistant") if a is not None}


def even_splits(state_messages: Sequence[dict], table: ObjectTable) -> list[str]:
    """The unasked attributes whose yes/no answer splits the still-possible objects most evenly (smallest
    |#yes - #no|), in ``attribute_order``; [] when no unasked attribute splits them at all (one object left, or
    every remaining attribute answered alike). Public: the transcript and the table only, never the refusal rule."""
    names, _ = candidates(state_messages, table)
    asked = asked_attributes(state_messages, table)
    unasked = [a for a in attribute_order(table) if a not in asked]
    if not names or not unasked:
        return []
    objs = [table.find(n) for n in names]
    balance = {a: abs(2 * sum(a in o.attributes for o in objs) - len(objs)) for a in unasked}
    best = min(balance.values())
    return [a for a in unasked if balance[a] == best] if best < len(objs) else []


@gin.configurable(module='nlac_jax.envs')
def state_lines(show_even_splits: bool = False) -> dict:
    """Which optional helper lines the compact 20 Questions state shows (gin): ``show_even_splits`` adds "Even
    splits: alive?, loud?." (``even_splits``). Every role and the policy read the same line."""
    return {"even_splits": bool(show_even_splits)}


def public_state(state_messages: Sequence[dict], table: Optional[ObjectTable] = None) -> dict:
    """The compact public state: {'history': ["alive? yes", "metal? can't answer", ...], 'candidates': [names],
    'left': questions left, 'world': the world's name, 'splits': ``even_splits`` as questions ["alive?", ...], or
    None when ``state_lines.show_even_splits`` is off}. ``table`` None: the world the system message names."""
    world = world_of(state_messages)
    table = table if table is not None else table_of_world(world)
    names, asked = candidates(state_messages, table)
    history, last = [], None
    for m in state_messages:
        if m.get("role") == "assistant":
            last = str(m.get("content", ""))
        elif m.get("role") == "user" and last is not None:
            history.append(f"{_short(last)} {answer_word(str(m.get('content', '')))}")
            last = None
    if last is not None:  # an action without its answer yet (never in a real state): shown unanswered
        history.append(f"{_short(last)} ?")
    n_max = MAX_QUESTIONS
    for m in state_messages:
        found = _MAX_RE.search(str(m.get("content", ""))) if m.get("role") == "system" else None
        if found:
            n_max = int(found.group(1))
            break
    splits = [f"{a}?" for a in even_splits(state_messages, table)] if state_lines()["even_splits"] else None
    return {"history": history, "candidates": names, "left": n_max - len(asked), "world": world, "splits": splits}


@gin.configurable(module='nlac_jax.envs')
def dominated_question(state: Sequence[dict], action: str) -> bool:
    """True iff ``action`` is dominated on the public transcript ``state`` and its world's table alone: a question
    or guess asked before, a guess of an object the answers already exclude, or a question every still-possible
    object answers alike (``twenty_questions.public_category``). The policy can see all three are useless; no
    hidden object and no refusal rule is read. An action the oracle's grammar cannot read is not judged here
    (False). The 20 Questions counterpart of ``envs.toy.dominated_guess``, for ``nlac.TargetConfig.target_filter``."""
    return public_category(state, action, table_of_world(world_of(state))) in ("repeat", "outside", "uninformative")
