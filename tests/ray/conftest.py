"""One local Ray instance per test session, shared by every test under tests/ray."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",  # never a `ray start` cluster that may run on this machine
            num_cpus=int(os.environ.get("HAMO_TEST_RAY_CPUS", "8")),
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )
    yield ray
    try:
        from ray import serve

        serve.shutdown()
    except Exception:
        pass
    ray.shutdown()
