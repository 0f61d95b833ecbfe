"""The tie between ``holdfast up`` and the service processes it starts.

Kept apart from both ends — the supervisor sets it, the ``holdfast <service>``
command honours it — so neither imports the other.
"""

from __future__ import annotations

import os
import signal
import sys

# Set by `holdfast up` in the environment of the services it starts.
SUPERVISOR_PID_ENV = "HOLDFAST_SUPERVISOR_PID"


def follow_supervisor() -> None:
    """Under `holdfast up`, end this process when the supervisor dies, even by SIGKILL.

    Without this a killed supervisor leaves services running that hold the
    gateway's port and the embedded servers' sockets.
    """
    supervisor = os.environ.get(SUPERVISOR_PID_ENV)
    if supervisor is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    # The supervisor may have died before prctl took effect.
    if os.getppid() != int(supervisor):
        raise SystemExit(0)
