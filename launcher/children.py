"""One child process of the launcher: its own process group, a log file, and a stop that always ends.

Children run in their own session, so a Ctrl-C in the terminal reaches only the launcher, which
then stops them in order. On Linux each child also asks the kernel to send it SIGTERM when the
launcher dies (PR_SET_PDEATHSIG), so even `kill -9` of the launcher leaves no orphan behind.

Exit checks use waitid(WNOWAIT): an exited leader stays a zombie until `reap`, so its process
group id cannot be reused while `stop_all` still signals the group.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _dies_with(parent_pid: int):
    def preexec() -> None:  # runs in the child between fork and exec
        if _prctl is not None:
            _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


class Child:
    """A started process with its output in ``log_path``."""

    def __init__(self, name: str, argv: Sequence[str], log_path: pathlib.Path, env: dict[str, str]) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_dies_with(os.getpid()),
        )
        self.pid = self.proc.pid

    def exit_code(self) -> int | None:
        """The exit code once the process ended (without reaping it), else None."""
        if self.proc.returncode is not None:
            return self.proc.returncode
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return self.proc.wait()
        if info is None:
            return None
        return -info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else info.si_status

    def signal_group(self, sig: int) -> None:
        """Signal the child and anything it started (its whole process group)."""
        if self.proc.returncode is None:  # not reaped: the group id is still ours
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)

    def reap(self) -> int:
        code = self.proc.wait()
        self._log.close()
        return code

    def log_tail(self, num_lines: int = 20) -> str:
        if not self._log.closed:  # reaped: closed, and all of it written
            self._log.flush()
        lines = self.log_path.read_bytes().decode(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])


def stop_all(children: Sequence[Child], timeout_s: float) -> None:
    """SIGTERM every child's group, wait up to timeout_s for them to exit, SIGKILL what is left
    (stragglers in the groups too), and reap. Returns only when every child is reaped."""
    for child in children:
        child.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while any(c.exit_code() is None for c in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    for child in children:
        child.signal_group(signal.SIGKILL)  # leaders still running, or grandchildren they left
        child.reap()
