"""Continual-learning metrics against hand-computed matrices."""

from __future__ import annotations

import math

import pytest

from hamo_ray.evaluation.metrics import (
    backward_transfer,
    forgetting,
    forward_transfer,
    mean_interval,
    stage_average,
    summarize,
)

# Cross-domain S -> A -> W: rows are stages, values scores after that stage.
CROSS = [
    {"S": 50.0, "A": 10.0, "W": 20.0},
    {"S": 40.0, "A": 60.0, "W": 25.0},
    {"S": 45.0, "A": 55.0, "W": 70.0},
]
DOMAINS = ["S", "A", "W"]
INITIAL = {"S": 30.0, "A": 5.0, "W": 15.0}


def test_averages_final_forgetting():
    assert stage_average(CROSS, "S") == pytest.approx(45.0)
    assert forgetting(CROSS, "S") == pytest.approx(5.0)  # best earlier 50, final 45
    assert forgetting(CROSS, "A") == pytest.approx(5.0)  # 60 -> 55
    assert forgetting(CROSS, "W") == 0.0  # never dropped
    assert forgetting(CROSS[:1], "S") == 0.0


def test_backward_and_forward_transfer():
    # BWT = ((R3,S - R1,S) + (R3,A - R2,A)) / 2 = ((45-50) + (55-60)) / 2 = -5
    assert backward_transfer(CROSS, DOMAINS) == pytest.approx(-5.0)
    # FWT = ((R1,A - b_A) + (R2,W - b_W)) / 2 = ((10-5) + (25-15)) / 2 = 7.5
    assert forward_transfer(CROSS, DOMAINS, INITIAL) == pytest.approx(7.5)
    assert forward_transfer(CROSS, DOMAINS, None) is None
    assert backward_transfer(CROSS[:1], DOMAINS) is None


def test_summary_of_a_run():
    m = summarize(CROSS, DOMAINS, INITIAL)
    assert m["final"] == CROSS[-1] and m["final_total"] == pytest.approx(170.0)
    assert m["retention"] == [30.0, 50.0, 40.0, 45.0]
    assert m["stage_scores"]["A"] == [10.0, 60.0, 55.0]
    assert m["average"]["W"] == pytest.approx(115.0 / 3)
    within = summarize([{"S": 10.0}, {"S": 30.0}])
    assert within["stage_domains"] == ["S", "S"] and within["backward_transfer"] == pytest.approx(20.0)


def test_mean_interval_over_seeds():
    r = mean_interval([10.0, 12.0, 14.0])
    assert r["mean"] == pytest.approx(12.0) and r["std"] == pytest.approx(2.0)
    # t(0.975, 2) = 4.302653; half width = 4.302653 * 2 / sqrt(3)
    assert r["ci_high"] - r["mean"] == pytest.approx(4.302653 * 2 / math.sqrt(3), rel=1e-5)
    one = mean_interval([5.0])
    assert one["mean"] == 5.0 and one["std"] is None
    assert mean_interval([])["n"] == 0
