"""The sandbox every process a tool starts runs in: bubblewrap + seccomp + Landlock + limits.

Entry points: ``run_sandboxed`` (one command, one result), ``start_resident`` (a
process that stays, talked to over its pipes: an MCP stdio server), ``launcher_pool`` (a pool
of processes spawned ahead of the calls, for a runner), ``reap_leftovers`` (the turn-end
watchdog), ``frozen`` (a task's processes held still while its workspace is archived)
and ``probe`` (what this host supports, for /health). Layers and their
reasons are documented in the module of each: ``bwrap`` (what is visible),
``seccomp`` (which syscalls), ``landlock`` (where writes may go), ``limits``
(resources and the kill switch), ``launchers`` (how a call's process starts),
``runner`` (timeouts, output, fail-closed).
"""

from .freezing import frozen
from .launchers import Launchers
from .policy import SandboxPolicy, SandboxResult, SandboxUnavailable
from .probe import SandboxProbe, probe
from .resident import Resident, start_resident
from .runner import Host, default_host, launcher_pool, reap_leftovers, run_sandboxed

__all__ = [
    "Host",
    "Launchers",
    "Resident",
    "SandboxPolicy",
    "SandboxProbe",
    "SandboxResult",
    "SandboxUnavailable",
    "default_host",
    "frozen",
    "launcher_pool",
    "probe",
    "reap_leftovers",
    "run_sandboxed",
    "start_resident",
]
