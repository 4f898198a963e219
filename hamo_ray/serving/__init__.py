"""The policy endpoint: Ray Serve + vLLM, OpenAI-compatible, LoRA adapters published at run time.

Driver side (see ``client``)::

    from hamo_ray.serving import publish_adapter, shutdown_policy_server, start_policy_server

The deployment itself is ``hamo_ray.serving.app`` and the engine ``hamo_ray.serving.engine``;
importing this package imports neither Ray Serve nor vLLM.
"""

from __future__ import annotations

from hamo_ray.serving.client import (
    AdapterNotLiveError,
    PolicyServerError,
    base_url,
    publish_adapter,
    shutdown_policy_server,
    start_policy_server,
    wait_healthy,
)

__all__ = [
    "AdapterNotLiveError",
    "PolicyServerError",
    "base_url",
    "publish_adapter",
    "shutdown_policy_server",
    "start_policy_server",
    "wait_healthy",
]
