"""The policy endpoint: Ray Serve replicas serving vLLM's own OpenAI app, LoRA adapters published at run time.

Driver side (``deploy`` starts it, ``client`` talks to it)::

    from hamo_ray.serving import publish_adapter, shutdown_policy_server, start_policy_server

The deployment is ``hamo_ray.serving.app``, the engine ``hamo_ray.serving.engine``; importing this
package imports neither Ray Serve nor vLLM.
"""

from __future__ import annotations

from hamo_ray.serving.client import (
    AdapterNotLiveError,
    PolicyServerError,
    base_url,
    direct_url,
    publish_adapter,
    wait_healthy,
)
from hamo_ray.serving.deploy import shutdown_policy_server, start_policy_server

__all__ = [
    "AdapterNotLiveError",
    "PolicyServerError",
    "base_url",
    "direct_url",
    "publish_adapter",
    "shutdown_policy_server",
    "start_policy_server",
    "wait_healthy",
]
