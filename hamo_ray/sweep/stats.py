"""A sweep's statistics: pure functions over the cells' ``metrics.json`` (no files, no plots).

Cells are grouped by setting (backbone, domain order, varied keys: ``setting_of``) and method; each
(setting, method) is summarised over its seeds as mean and 95% interval (``mean_interval``), the
stage average also paired with the base method's run of the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hamo_ray.evaluation.metrics import mean_interval

# The table's columns after setting, method and seeds: (summary key, index into it or None).
TABLE_COLUMNS = (
    ("average", None),
    ("vs_base", None),
    ("final_total", None),
    ("retention", -1),  # the first domain's score after the last stage
    ("forgetting_first", None),
    ("backward_transfer", None),
)


@dataclass(frozen=True)
class SettingStats:
    """One setting's summary per method, and what its plots need besides."""

    methods: dict[str, dict[str, Any]]  # method -> its summary (``method_summary``), methods sorted
    first_domain: str  # the stream's first domain (its retention is plotted)
    first_stage: int  # 0 when the runs evaluated before the first stage, else 1

    @property
    def curves(self) -> dict[str, dict[str, list[dict]]]:
        """Method -> domain -> the score interval after each stage (stage 0 first, when evaluated)."""
        return {m: s["stage_scores"] for m, s in self.methods.items()}

    @property
    def retention(self) -> dict[str, list[dict]]:
        """Method -> the first domain's score interval at each evaluation."""
        return {m: s["retention"] for m, s in self.methods.items()}


def stage_average(metrics: dict) -> float:
    """The mean over stages of the mean over domains of one run."""
    return sum(metrics["average"].values()) / len(metrics["average"])


def method_summary(runs: list[dict], base_average: dict[int, float]) -> dict[str, Any]:
    """One method's runs (one per seed) in one setting, summarised over the seeds.

    Args:
        runs: the runs' metrics, each with its ``seed``.
        base_average: the base method's stage average by seed (the paired ``vs_base``; empty: n/a).
    """
    domains = sorted(runs[0]["stage_scores"])
    first = runs[0]["first_domain"]
    stages = len(runs[0]["stage_scores"][domains[0]])
    before = (  # the evaluation before training (stage 0), when the runs made one
        {d: [mean_interval([r["initial"][d] for r in runs])] for d in domains}
        if runs[0].get("initial")
        else {d: [] for d in domains}
    )
    points = len(runs[0]["retention"])
    return {
        "seeds": len(runs),
        "average": mean_interval([stage_average(r) for r in runs]),
        # The same seed samples the same way in every method: differences to base cancel that luck.
        "vs_base": mean_interval(
            [stage_average(r) - base_average[r["seed"]] for r in runs if r["seed"] in base_average]
        ),
        "final_total": mean_interval([r["final_total"] for r in runs]),
        "forgetting_first": mean_interval([r["forgetting"].get(first, 0.0) for r in runs]),
        "stage_scores": {
            d: before[d] + [mean_interval([r["stage_scores"][d][t] for r in runs]) for t in range(stages)]
            for d in domains
        },
        "retention": [mean_interval([r["retention"][i] for r in runs]) for i in range(points)],
        "backward_transfer": mean_interval([r["backward_transfer"] for r in runs]),
        "forward_transfer": mean_interval([r["forward_transfer"] for r in runs]),
    }


def setting_stats(methods: dict[str, list[dict]]) -> SettingStats:
    """Every method of one setting (method -> its runs), in method order."""
    base_average = {r["seed"]: stage_average(r) for r in methods.get("base", [])}
    ordered = sorted(methods.items())
    last = ordered[-1][1][0]  # every method of a setting runs the same domains the same way
    return SettingStats(
        methods={method: method_summary(runs, base_average) for method, runs in ordered},
        first_domain=last["first_domain"],
        first_stage=0 if last.get("initial") else 1,
    )


def sweep_stats(groups: dict[str, dict[str, list[dict]]]) -> dict[str, SettingStats]:
    """Setting -> method -> runs, summarised per setting, in setting order."""
    return {setting: setting_stats(methods) for setting, methods in sorted(groups.items())}


def table_values(summary: dict[str, Any]) -> list[dict]:
    """The intervals of one (setting, method) summary shown in the table, in ``TABLE_COLUMNS`` order."""
    return [summary[key] if index is None else summary[key][index] for key, index in TABLE_COLUMNS]
