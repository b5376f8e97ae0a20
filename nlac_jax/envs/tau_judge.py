"""τ-bench's natural-language assertions, judged by an LLM (the NL_ASSERTION part of the reward).

tau2's ``NLAssertionsEvaluator`` asks a judge model (gpt-4o-mini by default, temperature 0) whether the agent met
each of a task's ``nl_assertions``, with a system prompt that fixes a JSON answer format
(``{"results": [{"expectedOutcome", "reasoning", "metExpectation"}]}``) and a user prompt holding the conversation
(one ``role: content`` line per message) and the assertions. ``judge_messages`` builds the same request;
``NLAssertionJudge`` sends it through any ``generate_fn`` over chat histories (``judges.OpenAIChatModel`` for an
endpoint) and ``parse_verdicts`` reads the reply.

Where we differ from tau2, deliberately: tau2 ``json.loads`` the reply (a malformed reply crashes the evaluation) and
counts only the results the judge returned (a judge that returns none passes every assertion). We never raise on a
reply: an assertion counts as met only when the judge returned ``metExpectation: true`` for it (matched by its text,
or by position when the judge returned exactly one result per assertion); a missing, malformed or garbled verdict is
"not met", with the reason in the check's justification. On a well-formed reply both give the same verdicts.
"""

from __future__ import annotations

import json
import re
from typing import Callable, Sequence

# tau2's judge instructions (evaluator_nl_assertions.py), dedented: the answer format is the part that matters.
SYSTEM_PROMPT = """TASK
- You will be given a list of expected outcomes and a conversation that was collected during a test case run.
- The conversation is between an agent and a customer.
- Your job is to evaluate whether the agent satisfies each of the expected outcomes.
- Grade each expected outcome individually.

FORMAT
- Your response should be a JSON object with the following fields:
- `reasoning`: a short explanation for your classification
- `metExpectation`: `true` if the agent satisfies the expected outcomes, `false` otherwise
- `expectedOutcome`: repeat the expectation from the input that you are grading

Example response structure:
{
    "results": [
        {
            "expectedOutcome": "<one of the expected outcomes from the input>",
            "reasoning": "<reasoning trace>",
            "metExpectation": <false or true>,
        }
    ]
}"""

USER_TEMPLATE = """conversation:
{conversation}

expectedOutcomes:
{assertions}"""

MAX_REPLY_CHARS = 200_000  # a judge reply longer than this is not parsed (it is no verdict)
_THINK_RE = re.compile(r'<think>.*?(</think>|$)', re.S | re.I)


def conversation_text(trajectory: Sequence) -> str:
    """tau2's rendering of a trajectory for the judge: one ``role: content`` line per message (tau2 message objects
    or dicts), tool calls and tool results included as they are."""
    lines = []
    for m in trajectory:
        role = m.get('role') if isinstance(m, dict) else getattr(m, 'role', '?')
        content = m.get('content') if isinstance(m, dict) else getattr(m, 'content', None)
        lines.append(f"{getattr(role, 'value', role)}: {content}")
    return '\n'.join(lines)


def judge_messages(trajectory: Sequence, nl_assertions: Sequence[str]) -> list:
    """The judge's chat: tau2's system prompt, then the conversation and the assertions (as tau2 lists them)."""
    return [{'role': 'system', 'content': SYSTEM_PROMPT},
            {'role': 'user', 'content': USER_TEMPLATE.format(conversation=conversation_text(trajectory),
                                                             assertions=list(nl_assertions))}]


def _norm(text) -> str:
    return ' '.join(str(text).split()).lower()


def _results(reply) -> tuple:
    """(list of result dicts, None) from a judge reply, or (None, why it could not be read). Never raises."""
    if not isinstance(reply, str):
        return None, f'the judge reply is {type(reply).__name__}, not text'
    if len(reply) > MAX_REPLY_CHARS:
        return None, f'the judge reply is {len(reply)} characters long'
    text = _THINK_RE.sub(' ', reply).strip()
    start, end = text.find('{'), text.rfind('}')
    if start < 0 or end <= start:
        return None, 'the judge reply holds no JSON object'
    blob = text[start:end + 1]
    data = None
    for candidate in (blob, re.sub(r',(\s*[}\]])', r'\1', blob)):  # tau2's own example has trailing commas
        try:
            data = json.loads(candidate)
            break
        except (ValueError, RecursionError):
            continue
    if data is None:
        return None, 'the judge reply is not valid JSON'
    results = data.get('results') if isinstance(data, dict) else None
    if not isinstance(results, list):
        return None, 'the judge reply has no "results" list'
    return [r for r in results if isinstance(r, dict)], None


def _met(value) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() == 'true')


def parse_verdicts(reply, nl_assertions: Sequence[str]) -> list:
    """One check per assertion, in order: ``{'nl_assertion', 'met', 'justification'}`` (module docstring for the
    matching rule; anything unreadable is "not met"). Never raises."""
    results, why = _results(reply)
    if results is None:
        return [{'nl_assertion': a, 'met': False, 'justification': f'no verdict: {why}'} for a in nl_assertions]
    by_text = {}
    for r in results:
        by_text.setdefault(_norm(r.get('expectedOutcome', '')), r)
    positional = len(results) == len(nl_assertions)
    checks = []
    for i, a in enumerate(nl_assertions):
        r = by_text.get(_norm(a)) or (results[i] if positional else None)
        if r is None:
            checks.append({'nl_assertion': a, 'met': False, 'justification': 'no verdict: the judge skipped it'})
        else:
            checks.append({'nl_assertion': a, 'met': _met(r.get('metExpectation')),
                           'justification': str(r.get('reasoning', ''))[:2000]})
    return checks


class NLAssertionJudge:
    """Judges a trajectory against NL assertions with ``generate_fn(list of chat histories) -> list[str]`` (e.g.
    ``judges.OpenAIChatModel``, whose errors -- an endpoint that is gone -- propagate as one line)."""

    def __init__(self, generate_fn: Callable[[list], list]):
        self.generate_fn = generate_fn

    def __call__(self, trajectory: Sequence, nl_assertions: Sequence[str]) -> list:
        """The checks of ``parse_verdicts``; no model call when there is nothing to judge."""
        if not nl_assertions:
            return []
        out = self.generate_fn([judge_messages(trajectory, nl_assertions)])
        if len(out) != 1:
            raise ValueError(f"NLAssertionJudge: generate_fn returned {len(out)} replies for 1 request")
        return parse_verdicts(out[0], nl_assertions)

