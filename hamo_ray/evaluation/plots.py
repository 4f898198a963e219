"""Plots of stage x domain scores (matplotlib, PNG), for one run and for a sweep.

- ``stagewise``: score per stage, one line per method (per domain) with the seed interval as a band
  (the paper's Figure 3);
- ``domain_bars``: bars per domain after each stage, one bar per method (Figure 4);
- ``retention``: the first domain's score over the stages, one line per method (Figure 7).

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


def _band(ax, xs, series, label):
    means = [s["mean"] for s in series]
    ax.plot(xs, means, marker="o", label=label)
    lows = [s["ci_low"] for s in series]
    highs = [s["ci_high"] for s in series]
    if all(v is not None for v in lows + highs):
        ax.fill_between(xs, lows, highs, alpha=0.2)


def stagewise(curves: Curves, path: str | Path, title: str = "Stage-wise scores") -> Path:
    plt = _plt()
    domains = sorted({d for per in curves.values() for d in per})
    fig, axes = plt.subplots(1, len(domains), figsize=(5 * len(domains), 3.6), squeeze=False)
    for ax, domain in zip(axes[0], domains, strict=True):
        for method, per in sorted(curves.items()):
            if domain in per:
                series = per[domain]
                _band(ax, list(range(1, len(series) + 1)), series, method)
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


def domain_bars(curves: Curves, path: str | Path, title: str = "Scores per domain after each stage") -> Path:
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
        ax.set_title(f"after stage {t + 1}")
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
    ax.set_title(f"Retention of the first domain ({domain})")
    ax.set_xlabel("stage (0 = before training, when evaluated)")
    ax.set_ylabel("score (0-100)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
