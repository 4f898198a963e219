"""The ScienceWorld simulator's JVM: the package's env with a capped heap, and JVM-error detection.

The package's ``ScienceWorldEnv.__init__`` calls py4j's ``launch_gateway`` with no JVM options
(an uncapped JVM reaches ~2.3 GB RSS). ``capped_env_class()`` subclasses it and re-does that
``__init__`` with ``javaopts=["-Xmx<heap>"]``; no monkeypatching. The package's Python callback
server is left out (the simulator never calls back into Python). The py4j gateway listens on loopback
and requires an auth token (``enable_auth``: a random token the JVM hands to this process over its
stdout pipe), so another local user who finds the port cannot run code in the JVM as the run's user
(the package's own launcher starts it open). The JVM's stderr is kept in a
small buffer (``stderr_tail``) for diagnosis. Startup ~1-2 s; with ``-Xmx512m`` the JVM's RSS was
~105 MB after start and ~575 MB after loading all 30 tasks (gold paths included).

Everything here is built on first use, so importing this module imports neither ``scienceworld`` nor
``py4j``; ``hamo_ray.envs.scienceworld`` is the domain that uses it.
"""

from __future__ import annotations

import collections
import functools
import logging
import subprocess
from typing import Any

logger = logging.getLogger(__name__)


@functools.cache
def capped_env_class() -> type:
    """``scienceworld.ScienceWorldEnv`` whose JVM is started with ``-Xmx<heap>`` (built on first use,
    so that importing this module does not import the package)."""
    import tempfile

    import scienceworld
    from py4j.java_gateway import GatewayParameters, JavaGateway, launch_gateway
    from scienceworld.constants import BASEPATH, JAR_PATH

    class HeapCappedScienceWorld(scienceworld.ScienceWorldEnv):
        """The package's env with a heap cap; same setup as its ``__init__`` otherwise."""

        def __init__(self, heap: str, step_limit: int = 100) -> None:
            self.stderr_tail: collections.deque[str] = collections.deque(maxlen=50)
            # enable_auth: the JVM makes a random token and prints it to our pipe only; a connection
            # that does not present it first is dropped (the gateway runs any code it is sent).
            port, token, proc = launch_gateway(
                classpath=JAR_PATH,
                javaopts=[f"-Xmx{heap}"],
                die_on_exit=True,
                cwd=BASEPATH,
                redirect_stderr=self.stderr_tail,
                return_proc=True,
                enable_auth=True,
            )
            self.java_process: subprocess.Popen = proc
            self._gateway = JavaGateway(
                gateway_parameters=GatewayParameters(auto_field=True, port=port, auth_token=token),
                java_process=proc,
            )
            self.server = self._gateway.jvm.scienceworld.runtime.pythonapi.PythonInterface()
            self.lastStepScore = 0
            self.taskName = None
            self.simplificationStr = ""
            self.variationIdx = 0
            self.envStepLimit = step_limit
            self.clear_run_histories()
            self.goldPathGenerated = False
            self._obj_tree_tempdir = tempfile.TemporaryDirectory()
            self._closed = False
            logger.info("ScienceWorld JVM pid %d on port %d (-Xmx%s)", proc.pid, port, heap)

        def close(self) -> None:
            """Shut the gateway down and wait for the JVM to exit (idempotent)."""
            if getattr(self, "_closed", True):
                return
            self._closed = True
            proc = self.java_process
            try:
                self._gateway.shutdown()
                if proc.poll() is None:  # py4j#320: the JVM exits on a newline / broken stdin
                    proc.stdin.write(b"\n")
                    proc.stdin.flush()
            except OSError:
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                logger.warning("ScienceWorld JVM pid %d did not exit; killing it", proc.pid)
                proc.kill()
                proc.wait(timeout=10)
            self._obj_tree_tempdir.cleanup()

    return HeapCappedScienceWorld


def is_jvm_error(err: Any) -> bool:
    """True for ``java.lang.Error`` subclasses (out of memory, stack overflow): not the action's fault."""
    cls = err.java_exception.getClass()
    while cls is not None:
        if cls.getName() == "java.lang.Error":
            return True
        cls = cls.getSuperclass()
    return False
