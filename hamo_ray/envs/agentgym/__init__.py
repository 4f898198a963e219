"""AgentGym's environment servers as HaMo domains: one client for their protocol, one row per server.

- ``protocol.py``: the servers' routes, payload fields and quirks; ``SERVERS``, one ``ServerSpec`` per
  environment (goal, first observation, score on 0-100, done, valid actions).
- ``client.py``: ``AgentGymEnv`` (the ``Env`` protocol over a server: create once, reuse across resets,
  close once; errors raised as episode errors, never a score of 0) and ``ServerClient`` (the transport:
  retries where the request cannot have arrived, errors, ``EnvSlots``: the bound per server).
- ``domains.py``: the ``textcraft`` and ``babyai`` domains (item tables, splits). ScienceWorld runs
  through its server with ``env.scienceworld.backend=agentgym`` (``hamo_ray.envs.scienceworld``).
- ``standin.py``: loopback servers speaking the protocol with its quirks (tests, smoke runs); the
  sciworld one runs the real simulator.

Adding another AgentGym environment: a row in ``protocol.SERVERS`` and a ``ServerDomain`` subclass with
its task types, tasks and item index (``docs/data.md``).
"""

from hamo_ray.envs.agentgym.client import AgentGymEnv, AgentGymError, ServerClient
from hamo_ray.envs.agentgym.domains import BabyAIDomain, TextCraftDomain
from hamo_ray.envs.agentgym.protocol import SERVERS, ServerSpec, server_spec

__all__ = [
    "SERVERS",
    "AgentGymEnv",
    "AgentGymError",
    "BabyAIDomain",
    "ServerClient",
    "ServerSpec",
    "TextCraftDomain",
    "server_spec",
]
