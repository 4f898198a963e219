"""A Serve app's name is leased cluster-wide before a job checks and deploys it (``run.serve_apps``).

Two drivers on one Ray cluster ask for the same app name at the same instant (a file barrier releases
them together): exactly one gets the lease, the other is refused naming the holder's pid. The holder's
driver is then SIGKILLed: Ray reaps its lease actor and a third job gets the name within the wait.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

DRIVER = """
import sys, time
from pathlib import Path
import ray
ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)
from hamo_ray.naming import AppExistsError
from hamo_ray.run.serve_apps import lease_apps
name, go, out = sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
out.with_suffix(".ready").touch()
while not go.exists():
    time.sleep(0.005)
try:
    lease_apps([name], out.parent / ".serve-apps.json")
    out.write_text("WON")
except AppExistsError as exc:
    out.write_text(f"REFUSED {exc}")
time.sleep(600)  # holds the lease until killed
"""


def _wait_for(paths, timeout_s=180.0):
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"drivers did not report: {[p for p in paths if not p.exists()]}"
        time.sleep(0.1)


@pytest.mark.timeout(300)
def test_one_of_two_racing_jobs_gets_an_app_name_and_a_killed_holder_frees_it(ray_session, tmp_path):
    import ray

    from hamo_ray.naming import AppExistsError
    from hamo_ray.run.serve_apps import lease_apps, lease_holder, unlease_apps

    record = tmp_path / ".serve-apps.json"
    # This process: a lease is taken once and kept (a second ask by the same job is no refusal).
    assert lease_apps(["lease-mine"], record) == ["lease-mine"]
    assert lease_apps(["lease-mine"], record) == []
    assert lease_holder("lease-mine")["pid"] == os.getpid()
    actor = ray.get_actor("app:lease-mine", namespace="hamo-serve-apps")
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    rss = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS"))
    print(f"a lease's worker process: {rss}")

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"PYTHONPATH": str(ROOT)}
    address, go = ray.get_runtime_context().gcs_address, tmp_path / "go"
    outs = [tmp_path / f"driver-{i}.txt" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", DRIVER, address, "lease-race", str(go), str(out)],
            env=env,
            cwd=tmp_path,
            start_new_session=True,
        )  # fmt: skip
        for out in outs
    ]
    mine = subprocess.Popen(
        [sys.executable, "-c", DRIVER, address, "lease-mine", str(go), str(tmp_path / "mine.txt")],
        env=env, cwd=tmp_path, start_new_session=True,
    )  # fmt: skip
    procs.append(mine)
    try:
        _wait_for([o.with_suffix(".ready") for o in [*outs, tmp_path / "mine.txt"]])
        go.touch()  # all at once
        _wait_for([*outs, tmp_path / "mine.txt"])
        said = [o.read_text() for o in outs]
        assert sorted(s.split()[0] for s in said) == ["REFUSED", "WON"], said
        winner = procs[said.index("WON")]
        assert f"pid {winner.pid} " in said[1 - said.index("WON")], said  # the refusal names the holder
        refused = (tmp_path / "mine.txt").read_text()  # a name this process holds: refused, naming it
        assert (
            refused.startswith("REFUSED") and f"pid {os.getpid()} " in refused and "'lease-mine'" in refused
        )

        with pytest.raises(AppExistsError, match=f"pid {winner.pid} "):
            lease_apps(["lease-race"], record, wait_s=5)
        os.killpg(winner.pid, signal.SIGKILL)  # the holder's driver dies: Ray reaps its lease actor
        winner.wait()
        t0 = time.monotonic()
        assert lease_apps(["lease-race"], record) == ["lease-race"]
        assert lease_holder("lease-race")["pid"] == os.getpid()
        print(f"a killed holder's name was free after {time.monotonic() - t0:.1f} s")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    unlease_apps(["lease-race", "lease-mine"])
    deadline = time.monotonic() + 30
    while lease_holder("lease-race") or lease_holder("lease-mine"):  # given back
        assert time.monotonic() < deadline, "leases not given back"
        time.sleep(0.2)
