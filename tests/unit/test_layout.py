"""The package's layout (docs/architecture.md): no import cycle, no upward import, few top-level modules,
short modules; a moved module's old name says where it went."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import check_layout  # noqa: E402


def test_the_layout_rules_hold():
    assert check_layout.violations() == []


def test_the_checker_finds_a_cycle_an_upward_import_and_a_long_module(tmp_path):
    pkg = tmp_path / "hamo_ray"
    (pkg / "config").mkdir(parents=True)
    (pkg / "run").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "config" / "__init__.py").write_text("def f():\n    from hamo_ray.run import stage\n")
    (pkg / "run" / "__init__.py").write_text("")
    (pkg / "run" / "stage.py").write_text("from hamo_ray.run import other\n" + "x = 1\n" * 401)
    (pkg / "run" / "other.py").write_text("def g():\n    import hamo_ray.run.stage\n")
    found = check_layout.violations(pkg)
    assert any(v.startswith("import cycle: hamo_ray.run.other <-> hamo_ray.run.stage") for v in found), found
    assert any("upward import: hamo_ray.config (layer 1) imports hamo_ray.run.stage" in v for v in found)
    assert any(v.startswith("hamo_ray/run/stage.py: 402 lines") for v in found)


@pytest.mark.parametrize(
    ("old", "new"),
    [("hamo_ray.stream", "hamo_ray.run.stream"), ("hamo_ray.sweep_export", "hamo_ray.sweep.export")],
)
def test_a_moved_module_names_its_new_place(old, new):
    with pytest.raises(ModuleNotFoundError, match=f"{old} has moved: import {new}"):
        importlib.import_module(old)


def test_the_script_exits_nonzero_on_a_violation(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_layout.py")], capture_output=True, text=True
    )
    assert (out.returncode == 0) == ("layout: ok" in out.stdout), out.stdout
