"""Continual-learning metrics from the stage x domain score matrix (pure functions).

``scores[t][d]`` is the mean score (0-100) on domain ``d``'s test set after stage ``t`` (0-based).
"""

from __future__ import annotations

import math


def stage_average(scores: list[dict[str, float]], domain: str) -> float:
    """Mean over stages of a domain's score (the paper's "average over stages")."""
    vals = [row[domain] for row in scores if domain in row]
    return sum(vals) / len(vals) if vals else math.nan


def final_scores(scores: list[dict[str, float]]) -> dict[str, float]:
    return dict(scores[-1]) if scores else {}


def forgetting(scores: list[dict[str, float]], domain: str) -> float:
    """Best earlier score minus the final score (0 when the domain never dropped)."""
    vals = [row[domain] for row in scores if domain in row]
    if len(vals) < 2:
        return 0.0
    return max(0.0, max(vals[:-1]) - vals[-1])


def summarize(scores: list[dict[str, float]]) -> dict:
    """The metrics written to ``results/metrics.json``."""
    domains = sorted({d for row in scores for d in row})
    final = final_scores(scores)
    return {
        "num_stages": len(scores),
        "stage_scores": {d: [row.get(d) for row in scores] for d in domains},
        "average": {d: stage_average(scores, d) for d in domains},
        "final": final,
        "final_total": sum(final.values()),
        "forgetting": {d: forgetting(scores, d) for d in domains},
    }
