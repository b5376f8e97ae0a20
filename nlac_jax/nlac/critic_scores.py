"""The critic read directly: P(success | s, a) from two scored continuations, and its AUC and Brier score.

Sampling a forecast and parsing its outcome gives a 0/1 per (s, a), whose noise floor is near 2p(1-p) per pair.
Scoring reads the successor model's distribution itself: every summary starts with the line
``Outcome: <success|failure>; Return: <r>`` (the summary format's contract), so right after the successor prompt

    P(success | s, a) = π(``Outcome: success``) / (π(``Outcome: success``) + π(``Outcome: failure``))

(log-probabilities under the parameter set that serves the successor role; the shared ``Outcome:`` tokens cancel).
It is one forward pass per continuation and has no sampling noise. The byte-level BPE pre-tokenizer splits
``;`` from the word before it, so these continuations tokenize as a prefix of the full line, as in training.

AUC (Mann-Whitney, ties counted 1/2) and Brier score (mean squared error of p against the 0/1 outcome) are
computed here with NumPy only, so they can be checked by hand.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = ["SUCCESS_CONTINUATION", "FAILURE_CONTINUATION", "success_probabilities", "auc", "brier"]

SUCCESS_CONTINUATION = "Outcome: success"
FAILURE_CONTINUATION = "Outcome: failure"


def success_probabilities(sampler, prompts, pairs: Sequence[tuple[list, str]], params: str = "policy") -> np.ndarray:
    """P(success | s, a) [N] float64 for (state, action) pairs, from ONE ``sampler.score`` call of the 2N
    continuations (role 'successor', so a routed successor, e.g. the frozen critic, is the one read).
    NaN where a score is not finite (e.g. a scripted sampler without scores)."""
    if not pairs:
        return np.zeros(0, np.float64)
    msgs = [prompts.successor(s, a) for s, a in pairs]
    n = len(msgs)
    lp = np.asarray(sampler.score(msgs + msgs, [SUCCESS_CONTINUATION] * n + [FAILURE_CONTINUATION] * n, params,
                                  "successor"), np.float64)
    d = lp[:n] - lp[n:]  # log-odds of success
    with np.errstate(over="ignore", invalid="ignore"):
        return np.where(np.isfinite(d), 1.0 / (1.0 + np.exp(-d)), math.nan)


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of x, ties sharing the mean of their ranks."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    ranks = np.empty(len(x), np.float64)
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and xs[j + 1] == xs[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def auc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """Area under the ROC curve of `scores` for the 0/1 `labels`: the probability that a random positive scores
    above a random negative, ties counted 1/2 (rank-sum form). NaN when either class is absent."""
    s = np.asarray(scores, np.float64)
    y = np.asarray(labels, bool)
    if s.shape != y.shape:
        raise ValueError(f"{s.shape[0] if s.ndim else s} scores for {y.shape[0] if y.ndim else y} labels")
    n1 = int(y.sum())
    n0 = len(y) - n1
    if n1 == 0 or n0 == 0:
        return math.nan
    r = _average_ranks(s)
    return float((r[y].sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0))


def brier(p: Sequence[float], labels: Sequence[bool]) -> float:
    """Mean (p - y)²: 0 for perfect forecasts, 0.25 for a constant 1/2. NaN for no pairs."""
    p = np.asarray(p, np.float64)
    y = np.asarray(labels, np.float64)
    if p.shape != y.shape:
        raise ValueError(f"{p.shape} probabilities for {y.shape} labels")
    return float(np.mean((p - y) ** 2)) if len(p) else math.nan
