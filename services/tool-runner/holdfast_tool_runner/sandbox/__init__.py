"""The sandbox every process a tool starts runs in: bubblewrap + seccomp + Landlock + limits.

Entry points: ``run_sandboxed`` (one command, one result), ``reap_leftovers`` (the
turn-end watchdog) and ``probe`` (what this host supports, for /health). Layers and
their reasons are documented in the module of each: ``bwrap`` (what is visible),
``seccomp`` (which syscalls), ``landlock`` (where writes may go), ``limits``
(resources and the kill switch), ``runner`` (timeouts, output, fail-closed).
"""

from .policy import SandboxPolicy, SandboxResult, SandboxUnavailable
from .probe import SandboxProbe, probe
from .runner import reap_leftovers, run_sandboxed

__all__ = [
    "SandboxPolicy",
    "SandboxProbe",
    "SandboxResult",
    "SandboxUnavailable",
    "probe",
    "reap_leftovers",
    "run_sandboxed",
]
