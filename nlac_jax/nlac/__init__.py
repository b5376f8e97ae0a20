"""Natural Language Actor-Critic: prompts (one registry), targets, parsers, evaluation.

The role-sampling interface (RoleSampler, Completion, RoleSampling settings) lives upstream in ``nlac_jax.rl.roles``,
shared with ``nlac_jax.rl``; nlac may import rl, never the other way round.
"""

from nlac_jax.nlac.prompts import (
    CHAT_ROLES,
    DEFAULT_SET,
    ROLES,
    PromptSet,
    PromptTemplate,
    available_prompt_sets,
    get_prompt_set,
    render_transcript,
)
from nlac_jax.nlac.targets import (
    CriticExample,
    PolicyExample,
    TargetConfig,
    TargetStats,
    build_critic_examples,
    build_nlac_examples,
    build_policy_examples,
    format_examples_for_humans,
    trainable,
    truncate_summary,
)
from nlac_jax.nlac.verdict import (
    clean_action,
    format_return,
    outcome_line,
    parse_outcome,
    parse_verdict,
    replace_outcome_line,
)

__all__ = [
    "CHAT_ROLES",
    "DEFAULT_SET",
    "ROLES",
    "CriticExample",
    "PolicyExample",
    "PromptSet",
    "PromptTemplate",
    "TargetConfig",
    "TargetStats",
    "available_prompt_sets",
    "build_critic_examples",
    "build_nlac_examples",
    "build_policy_examples",
    "clean_action",
    "format_examples_for_humans",
    "format_return",
    "get_prompt_set",
    "outcome_line",
    "parse_outcome",
    "parse_verdict",
    "render_transcript",
    "trainable",
    "replace_outcome_line",
    "truncate_summary",
]
