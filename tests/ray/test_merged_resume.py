"""SIGKILL the stream during a stage's evaluation on merged weights, resubmit, and check which weights
the resumed stage evaluated.

``serve.eval_weights=merged``: each stage's evaluation runs on a second Serve app whose engine holds
the stage adapter merged into the base weights, in a node-local slot folder reused from stage to stage
(its marker names the adapter's content digest). A stage killed mid-evaluation leaves that slot
holding the killed attempt's weights; the resumed run redoes the stage (a new adapter) and must
evaluate the new adapter's weights, never the slot's stale ones: the served name carries the adapter
folder's digest, the merged replica refuses a slot whose marker names another digest, and the driver
checks that the engine states that name before any episode.
"""

from __future__ import annotations

import csv
import json
import re
import time
from pathlib import Path

import pytest
from test_resume import OVERRIDES as RESUME_OVERRIDES  # tests/ray is on sys.path (rootdir conftest)
from test_resume import _kill_tree
from test_resume import _start as _start_stream

OVERRIDES = [
    *(o for o in RESUME_OVERRIDES if not o.startswith(("serve.port=", "serve.app_name="))),
    "serve.port=18473",
    "serve.app_name=hamo-merged-resume-test",
    "serve.eval_weights=merged",
    "serve.merged_swap=true",  # one engine taking each stage's weights in place (passed 2026-12-06)
]
ACTING = re.compile(r"acting as '([^']*stage-(\d+):([0-9a-f]{12}))' on merged weights")


def _start(root: Path, log: Path, cache: Path):
    return _start_stream(root, log, OVERRIDES, HAMO_MERGED_CACHE=str(cache))


def _markers(cache: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in cache.glob("*/hamo_merged.json")]


@pytest.mark.timeout(1200)
@pytest.mark.slow  # ~6 min on 2 cores: bash scripts/test.sh -m slow tests/ray/test_merged_resume.py
def test_stage_killed_during_merged_evaluation_resumes_on_its_own_weights(tmp_path):
    from hamo_ray.serving.objstore import folder_digest

    root, log, cache = tmp_path / "runs", tmp_path / "stream.log", tmp_path / "merged"
    run = root / "r"
    proc = _start(root, log, cache)
    deadline = time.time() + 900
    killed_name = None
    try:
        while killed_name is None:
            assert proc.poll() is None, (
                f"stream ended before stage 2's evaluation:\n{log.read_text()[-3000:]}"
            )
            assert time.time() < deadline, (
                f"stage 2 never evaluated on merged weights:\n{log.read_text()[-3000:]}"
            )
            hits = [m for m in ACTING.finditer(log.read_text()) if m.group(2) == "2"]
            if hits:
                killed_name = hits[0].group(1)
            else:
                time.sleep(0.2)
        _kill_tree(proc)  # stage 2's episodes on merged weights are under way (or about to start)
    finally:
        if proc.poll() is None:
            proc.kill()
    state = json.loads((run / "state.json").read_text())
    assert 1 in [s["stage"] for s in state["stages"]], "stage 1 not committed before the kill"
    assert 2 not in [s["stage"] for s in state["stages"]], "stage 2 committed before the kill"
    stale = [m for m in _markers(cache) if killed_name.split(":")[-1] in m["adapter_digest"][:12]]
    assert stale, f"no merged slot holds the killed stage's weights: {_markers(cache)}"
    killed_log_size = len(log.read_text())  # characters, as the slice below counts

    second = _start(root, log, cache)
    assert second.wait(timeout=900) == 0, log.read_text()[-4000:]

    resumed_log = log.read_text()[killed_log_size:]
    assert "resuming" in resumed_log
    digest = folder_digest(run / "adapters" / "stage-2")
    acted = [m for m in ACTING.finditer(resumed_log) if m.group(2) == "2"]
    assert acted, f"the resumed stage 2 did not act on merged weights:\n{resumed_log[-4000:]}"
    # Every merged evaluation of the resumed stage 2 named the adapter folder it committed.
    assert {m.group(3) for m in acted} == {digest[:12]}, (killed_name, [m.group(1) for m in acted], digest)
    state = json.loads((run / "state.json").read_text())
    assert [s["stage"] for s in state["stages"]][-2:] == [1, 2]
    stage2 = state["stages"][-1]
    assert stage2["adapter_name"].endswith(f"stage-2:{digest[:12]}"), stage2["adapter_name"]
    assert stage2["evaluation"]["episodes"] > 0 and stage2["evaluation"]["failed_episodes"] == 0
    # The slot the resumed evaluation used now holds the committed adapter's merge.
    assert any(m["adapter_digest"] == digest for m in _markers(cache)), _markers(cache)
    with open(run / "results" / "scores.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["stage"] for r in rows] == ["1", "2"]
