"""What a child process that redbatch spawns (a worker replica, a gateway process) does
first: it leaves Ctrl-C to its parent, and it dies with its parent.

* A Ctrl-C in the terminal reaches the whole foreground process group.  The parent
  (``redbatch up``, ``redbatch worker``, ``redbatch gateway``) stops its children in
  order (the gateways answer what they accepted before the workers stop), so a child
  ignores SIGINT and stops on the parent's SIGTERM.
* A parent killed outright (SIGKILL, the OOM killer) cannot stop them: on Linux the
  kernel sends each child SIGTERM then (``PR_SET_PDEATHSIG``), so no replica keeps
  holding a lease and no gateway keeps the port.  (The signal follows the parent's
  thread that started the child: the supervisors' threads live until they have
  stopped their children.)
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
_STATE = {"supervised": False}  # this process is such a child: SIGINT is its parent's


def is_supervised() -> bool:
    """Whether ``supervised_child`` ran in this process."""
    return _STATE["supervised"]


def supervised_child() -> None:
    """Call first thing in a spawned child."""
    _STATE["supervised"] = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform != "linux":
        return
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before the prctl
        os.kill(os.getpid(), signal.SIGTERM)
