"""The run folder's guarantees: one commit (results first, state last, durable), one job per folder, a
run id that is a name, releases of an uncommitted stage undone; adapters named by their content."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hamo_ray.config import ConfigError, load_config
from hamo_ray.run.folder import RunFolder, RunLockedError, atomic_write, committed_stage_count
from hamo_ray.types import StageResult


def _cfg(tmp_path, *extra):
    return load_config("jobs/configs/tiny.yaml", [f"run.root={tmp_path}", *extra])


def _stage(t: int, score: float = 10.0) -> StageResult:
    return StageResult(
        stage=t, method="hamo", domain="scienceworld", num_trajectories=1, num_cards=1, budget=1, anchors=[], replay=[], adapter=None,
        adapter_name=None, train_loss=None, scores={"scienceworld": score}, seconds={},
    )  # fmt: skip


def test_a_kill_between_results_and_state_leaves_the_stage_uncommitted(tmp_path, monkeypatch):
    import hamo_ray.run.folder as rf

    folder = RunFolder(tmp_path / "r", _cfg(tmp_path, "run.id=r"))
    folder.prepare()
    folder.commit(_stage(1))
    real = rf.atomic_write

    def dies_at_the_state(path, text):
        if path.name == "state.json":
            raise KeyboardInterrupt("killed between the results and the state")
        real(path, text)

    monkeypatch.setattr(rf, "atomic_write", dies_at_the_state)
    with pytest.raises(KeyboardInterrupt):
        folder.commit(_stage(2, 20.0))
    monkeypatch.setattr(rf, "atomic_write", real)
    # resume sees stage 1 only (stage 2 is redone); the results already list stage 2, so a sweep reading
    # them is told by the state that they hold an uncommitted stage
    assert [s.stage for s in folder.stages()] == [1]
    rows = (folder.path / "results" / "scores.csv").read_text().splitlines()
    assert len(rows) == 3 and committed_stage_count(folder.path) == 1
    folder.commit(_stage(2, 21.0))  # the redo rewrites them
    assert [s.stage for s in folder.stages()] == [1, 2] and committed_stage_count(folder.path) == 2
    assert "21.0000" in (folder.path / "results" / "scores.csv").read_text()


def test_a_stage_listed_in_the_state_always_has_its_rows(tmp_path, monkeypatch):
    import hamo_ray.run.folder as rf

    folder = RunFolder(tmp_path / "r", _cfg(tmp_path, "run.id=r"))
    folder.prepare()
    real = rf.atomic_write

    def disk_full_at_the_results(path, text):
        if path.parent.name == "results":
            raise OSError(28, "No space left on device")
        real(path, text)

    monkeypatch.setattr(rf, "atomic_write", disk_full_at_the_results)
    with pytest.raises(OSError, match="No space"):
        folder.commit(_stage(1))
    assert folder.stages() == []  # not committed: resume redoes it


def test_atomic_write_keeps_the_old_file_whole_and_leaves_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "state.json"
    atomic_write(target, "old")

    def fsync_fails(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync_fails)
    with pytest.raises(OSError):
        atomic_write(target, "new")
    monkeypatch.undo()
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
    atomic_write(target, "new")
    assert target.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_second_job_on_the_same_run_folder_is_refused_naming_the_holder(tmp_path):
    folder = RunFolder(tmp_path / "r", _cfg(tmp_path, "run.id=r"))
    folder.lock()
    other = RunFolder(tmp_path / "r", _cfg(tmp_path, "run.id=r"))
    with pytest.raises(RunLockedError, match=rf"in use by another job \(host .*, pid {os.getpid()}"):
        other.lock()
    # another process too (a second `ray job submit` of the same run)
    code = (
        "import sys; from hamo_ray.config import load_config; from hamo_ray.run.folder import RunFolder\n"
        f"f = RunFolder({str(tmp_path / 'r')!r}, load_config('jobs/configs/tiny.yaml', []))\n"
        "try:\n    f.lock()\nexcept Exception as e:\n    print(type(e).__name__, e); sys.exit(3)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 3 and "RunLockedError" in out.stdout and f"pid {os.getpid()}" in out.stdout
    folder.unlock()
    other.lock()  # released: the next job takes it
    other.unlock()


def test_a_killed_job_releases_the_folder(tmp_path):
    code = (
        "import os, time; from hamo_ray.config import load_config; from hamo_ray.run.folder import RunFolder\n"
        f"f = RunFolder({str(tmp_path / 'r')!r}, load_config('jobs/configs/tiny.yaml', []))\nf.lock()\n"
        "print('locked', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    folder = RunFolder(tmp_path / "r", _cfg(tmp_path, "run.id=r"))
    with pytest.raises(RunLockedError, match=f"pid {proc.pid}"):
        folder.lock()
    proc.kill()
    proc.wait()
    folder.lock()
    folder.unlock()


@pytest.mark.parametrize("bad", ["..", "../escape", "a/b", "/abs", ".hidden", "x" * 101, "a b"])
def test_run_id_is_a_name_not_a_path(tmp_path, bad):
    with pytest.raises(ConfigError, match="run.id"):
        _cfg(tmp_path, f"run.id={bad}")


def test_the_dry_run_refuses_a_path_as_run_id():
    out = subprocess.run(
        [sys.executable, "jobs/stream.py", "--config", "jobs/configs/tiny.yaml", "--dry-run", "run.id=../x"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode != 0 and "run.id" in out.stderr + out.stdout


def test_overwrite_deletes_only_a_run_folder(tmp_path):
    precious = tmp_path / "notes"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    with pytest.raises(ConfigError, match="no run folder"):
        RunFolder(precious, _cfg(tmp_path, "run.id=notes", "run.overwrite=true")).prepare()
    assert (precious / "thesis.tex").read_text() == "years of work"
    folder = RunFolder(tmp_path / "r", _cfg(tmp_path, "run.id=r"))
    folder.prepare()
    folder.commit(_stage(1))
    again = RunFolder(tmp_path / "r", _cfg(tmp_path, "run.id=r", "run.overwrite=true"))
    again.lock()
    assert again.prepare() == [] and not (tmp_path / "r" / "state.json").exists()
    assert (tmp_path / "r" / ".lock").exists()  # the holder's lock stays while it runs
    again.unlock()


def test_restore_releases_undoes_only_uncommitted_releases(tmp_path):
    import numpy as np

    from hamo_ray.memory import MemoryStore, card_from_trajectory
    from hamo_ray.types import TaskSpec, Trajectory

    store = MemoryStore(str(tmp_path / "mem"), dim=4)
    rows = []
    for v in range(4):
        traj = Trajectory(task=TaskSpec(domain="scienceworld", task="boil", variation=v), goal=f"g{v}",
                          init_obs="o", actions=["a"], observations=["b"], score=100.0, source="expert")  # fmt: skip
        card = card_from_trajectory(traj, 1, "outline")
        vec = np.zeros(4, dtype=np.float32)
        vec[v] = 1.0
        rows.append(card.model_dump() | {"vector": vec.tolist()})
    store.add(rows)
    ids = [r["id"] for r in rows]
    assert store.restore_releases({ids[0]}) == 0  # nothing released yet
    store.release([ids[0], ids[1], ids[2]])  # ids[0] by a committed stage; ids[1], ids[2] by the killed one
    assert store.restore_releases({ids[0]}) == 2
    assert store.count(include_released=False) == 3
    assert store.restore_releases({ids[0]}) == 0


def test_a_stage_adapter_name_is_loaded_only_while_its_folder_holds_those_weights(tmp_path):
    from hamo_ray.serving.adapters import AdapterError, AdapterRegistry
    from hamo_ray.serving.objstore import folder_digest

    folder = tmp_path / "adapters" / "stage-2"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4}))
    (folder / "adapter_model.safetensors").write_bytes(b"first attempt")
    first = f"stage-2:{folder_digest(folder)[:12]}"
    registry = AdapterRegistry(tmp_path / "adapters", {"base"}, 16)
    assert registry.check(first, "stage-2") == (folder.resolve(), False)
    registry.add(first, folder.resolve())
    (folder / "adapter_model.safetensors").write_bytes(b"the redone stage's weights")  # resumed, retrained
    with pytest.raises(AdapterError, match="rewritten after it was published") as err:
        registry.check(first, "stage-2")  # a replica adopting the old name never loads the new files
    assert err.value.status == 409
    second = f"stage-2:{folder_digest(folder)[:12]}"
    assert second != first and registry.check(second, "stage-2") == (folder.resolve(), False)
    assert registry.check("stage-2", "stage-2")[0] == folder.resolve()  # names without a digest: as before
