"""Continual-learning metrics from the stage x domain score matrix (pure functions).

``scores[t][d]`` is the mean score (0-100) on domain ``d``'s test set after stage ``t + 1``;
``initial[d]`` (optional) is the score before any stage (``protocol.eval_initial``);
``stage_domains[t]`` is the domain whose data stage ``t + 1`` trained on (the same domain at every
stage in the within-domain protocol).

Definitions (T stages, R[i][j] = score on the domain of stage j after stage i, 1-based):

- average over stages: mean over t of scores[t][d];
- final: scores[T][d]; final total: sum over domains of the final scores;
- retention of the first domain: its curve over stages (initial score first, when known);
- forgetting of d: max over t < T of scores[t][d] minus scores[T][d] (Chaudhry et al. 2018);
- a domain evaluated on its dev split too (``protocol.eval_seen``) has a column ``<domain>@seen``,
  reported like any domain but left out of the final total;
- backward transfer BWT = 1/(T-1) sum_{i<T} (R[T][i] - R[i][i]) (Lopez-Paz & Ranzato 2017);
- forward transfer FWT = 1/(T-1) sum_{i>=2} (R[i-1][i] - b_i), b_i = the initial score on the domain
  of stage i (needs ``initial``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Matrix = Sequence[dict[str, float]]

# A second evaluation set of a domain (``protocol.eval_seen``: its dev split, e.g. ALFWorld's seen rooms)
# is a column ``<domain>@seen`` of the matrix: reported beside the domain, never part of the final total
# or a stage average over domains.
SEEN = "@seen"


def base_domain(column: str) -> str:
    """The domain a score column belongs to (``alfworld@seen`` -> ``alfworld``)."""
    return column.removesuffix(SEEN)


def scored(columns) -> list[str]:
    """The columns that count in totals and averages over domains (the test splits)."""
    return [c for c in columns if not c.endswith(SEEN)]


def stage_average(scores: Matrix, domain: str) -> float:
    """Mean over stages of a domain's score (the paper's "average over stages")."""
    vals = [row[domain] for row in scores if domain in row]
    return sum(vals) / len(vals) if vals else math.nan


def final_scores(scores: Matrix) -> dict[str, float]:
    return dict(scores[-1]) if scores else {}


def forgetting(scores: Matrix, domain: str) -> float:
    """Best earlier score minus the final score (0 when the domain never dropped)."""
    vals = [row[domain] for row in scores if domain in row]
    if len(vals) < 2:
        return 0.0
    return max(0.0, max(vals[:-1]) - vals[-1])


def backward_transfer(scores: Matrix, stage_domains: Sequence[str]) -> float | None:
    """BWT: how training on later stages changed the score on earlier stages' domains."""
    t = len(scores)
    if t < 2:
        return None
    return sum(scores[-1][stage_domains[i]] - scores[i][stage_domains[i]] for i in range(t - 1)) / (t - 1)


def forward_transfer(
    scores: Matrix, stage_domains: Sequence[str], initial: dict[str, float] | None
) -> float | None:
    """FWT: the score on a stage's domain just before training on it, over the initial score."""
    t = len(scores)
    if t < 2 or not initial:
        return None
    return sum(scores[i - 1][stage_domains[i]] - initial[stage_domains[i]] for i in range(1, t)) / (t - 1)


def summarize(
    scores: Matrix, stage_domains: Sequence[str] | None = None, initial: dict[str, float] | None = None
) -> dict:
    """The metrics of one run, as written to ``results/metrics.json``."""
    domains = sorted({d for row in scores for d in row})
    stage_domains = list(stage_domains or ([domains[0]] * len(scores) if domains else []))
    final = final_scores(scores)
    first = stage_domains[0] if stage_domains else None
    retention = ([initial[first]] if initial and first in initial else []) + [
        row.get(first) for row in scores
    ]
    return {
        "num_stages": len(scores),
        "stage_domains": stage_domains,
        "initial": initial,
        "stage_scores": {d: [row.get(d) for row in scores] for d in domains},
        "average": {d: stage_average(scores, d) for d in domains},
        "final": final,
        "final_total": sum(final[d] for d in scored(final)),
        "first_domain": first,
        "retention": retention,
        "forgetting": {d: forgetting(scores, d) for d in domains},
        "backward_transfer": backward_transfer(scores, stage_domains),
        "forward_transfer": forward_transfer(scores, stage_domains, initial),
    }


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> dict[str, float | int | None]:
    """Mean, sample standard deviation and the two-sided t interval over seeds.

    With one value the standard deviation and interval are None (no variance from one run).
    """
    vals = [float(v) for v in values if v is not None and not math.isnan(v)]
    n = len(vals)
    if n == 0:
        return {"n": 0, "mean": None, "std": None, "ci_low": None, "ci_high": None}
    mean = sum(vals) / n
    if n == 1:
        return {"n": 1, "mean": mean, "std": None, "ci_low": None, "ci_high": None}
    from scipy import stats

    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1))
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * std / math.sqrt(n)
    return {"n": n, "mean": mean, "std": std, "ci_low": mean - half, "ci_high": mean + half}


def fmt(interval: dict, digits: int = 2, missing: str = "n/a") -> str:
    """``mean ± half-width``, the mean alone with one seed, ``missing`` without a value."""
    if interval["mean"] is None:
        return missing
    if interval["std"] is None:
        return f"{interval['mean']:.{digits}f}"
    return f"{interval['mean']:.{digits}f} ± {(interval['ci_high'] - interval['mean']):.{digits}f}"
