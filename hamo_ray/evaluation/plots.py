"""Plots of stage x domain scores (matplotlib, PNG), for one run and for a sweep.

- ``stagewise``: score per stage, one line per method (per domain) with the seed interval as a band
  (the paper's Figure 3);
- ``domain_bars``: bars per domain after each stage, one bar per method (Figure 4);
- ``retention``: the first domain's score over the stages, one line per method (Figure 7);
- ``write_run_report``: the three plots and ``report.md`` of one run folder, from its metrics.json.

Stages are integers on every axis; stage 0 is the evaluation before any training, when a run made one.

Every function takes ``curves``: ``{method: {domain: [summary per stage]}}`` where a summary is the
``mean_interval`` dict (``mean``, ``ci_low``, ``ci_high``), and writes one PNG.
"""

from __future__ import annotations

from pathlib import Path

Curves = dict[str, dict[str, list[dict]]]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _integer_stages(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _band(ax, xs, series, label):
    means = [s["mean"] for s in series]
    ax.plot(xs, means, marker="o", label=label)
    lows = [s["ci_low"] for s in series]
    highs = [s["ci_high"] for s in series]
    if all(v is not None for v in lows + highs):
        ax.fill_between(xs, lows, highs, alpha=0.2)


def stagewise(
    curves: Curves, path: str | Path, title: str = "Stage-wise scores", first_stage: int = 1
) -> Path:
    """Score per stage; ``first_stage`` is 0 when the curves start with the evaluation before training."""
    plt = _plt()
    domains = sorted({d for per in curves.values() for d in per})
    fig, axes = plt.subplots(1, len(domains), figsize=(5 * len(domains), 3.6), squeeze=False)
    for ax, domain in zip(axes[0], domains, strict=True):
        for method, per in sorted(curves.items()):
            if domain in per:
                series = per[domain]
                _band(ax, list(range(first_stage, first_stage + len(series))), series, method)
        _integer_stages(ax)
        ax.set_title(domain)
        ax.set_xlabel("stage")
        ax.set_ylabel("score (0-100)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def domain_bars(
    curves: Curves, path: str | Path, title: str = "Scores per domain after each stage", first_stage: int = 1
) -> Path:
    import numpy as np

    plt = _plt()
    domains = sorted({d for per in curves.values() for d in per})
    methods = sorted(curves)
    stages = max((len(s) for per in curves.values() for s in per.values()), default=0)
    fig, axes = plt.subplots(1, max(1, stages), figsize=(4.5 * max(1, stages), 3.6), squeeze=False)
    width = 0.8 / max(1, len(methods))
    for t in range(stages):
        ax = axes[0][t]
        for i, method in enumerate(methods):
            vals = [
                curves[method].get(d, [])[t]["mean"] if t < len(curves[method].get(d, [])) else 0
                for d in domains
            ]
            ax.bar(np.arange(len(domains)) + i * width, vals, width, label=method)
        ax.set_xticks(np.arange(len(domains)) + width * (len(methods) - 1) / 2, domains, fontsize=8)
        stage = first_stage + t
        ax.set_title("before training" if stage == 0 else f"after stage {stage}")
        ax.set_ylim(0, 100)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def retention(curves: dict[str, list[dict]], path: str | Path, domain: str, first_stage: int = 1) -> Path:
    """``curves``: ``{method: [summary per point]}``, the first domain's score from ``first_stage`` on."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for method, series in sorted(curves.items()):
        _band(ax, list(range(first_stage, first_stage + len(series))), series, method)
    _integer_stages(ax)
    ax.set_title(f"Retention of the first domain ({domain})")
    ax.set_xlabel("stage (0 = before training, when evaluated)")
    ax.set_ylabel("score (0-100)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _num(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def write_run_report(run_dir: str | Path) -> Path:
    """Plots and ``report.md`` of one run from its ``results/metrics.json`` (a sweep's report, for one run).

    Returns:
        The path of ``report.md``.
    """
    import json

    from hamo_ray.evaluation.metrics import mean_interval

    run_dir = Path(run_dir)
    results = run_dir / "results"
    m = json.loads((results / "metrics.json").read_text())
    method = m.get("method", "run")
    initial = m.get("initial") or {}
    first_stage = 0 if initial else 1
    domains = sorted(m["stage_scores"])
    rows = {d: ([initial[d]] if initial else []) + list(m["stage_scores"][d]) for d in domains}
    curves = {method: {d: [mean_interval([v]) for v in rows[d]] for d in domains}}
    pngs = [
        stagewise(curves, results / "stagewise.png", f"Stage-wise scores: {run_dir.name}", first_stage),
        domain_bars(
            curves, results / "bars.png", f"Per domain after each stage: {run_dir.name}", first_stage
        ),
        retention(
            {method: [mean_interval([v]) for v in m["retention"]]},
            results / "retention.png",
            m["first_domain"],
            first_stage,
        ),
    ]
    stages = list(range(first_stage, first_stage + len(rows[domains[0]]))) if domains else []
    lines = [f"# Run {run_dir.name} ({method})", "", "| stage | " + " | ".join(domains) + " |"]
    lines.append("|---:|" + "---:|" * len(domains))
    for i, stage in enumerate(stages):
        cells = " | ".join("n/a" if rows[d][i] is None else f"{rows[d][i]:.2f}" for d in domains)
        lines.append(f"| {stage} | {cells} |")
    average = ", ".join(f"{d} {v:.2f}" for d, v in sorted(m["average"].items()) if v is not None)
    lines += [
        "",
        f"Average over stages: {average}. Final total: {m['final_total']:.2f}. "
        f"Backward transfer: {_num(m.get('backward_transfer'))}. Budgets: {m.get('budgets')}.",
        "",
    ]
    lines += [f"![{png.stem}](results/{png.name})" for png in pngs] + [""]
    report = run_dir / "report.md"
    report.write_text("\n".join(lines))
    return report
