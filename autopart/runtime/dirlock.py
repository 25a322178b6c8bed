"""One run per checkpoint folder: an exclusive ``flock`` on ``FOLDER/.autopart.lock``, taken
by rank 0 of ``autopart run --checkpoint-dir`` and of ``autopart train`` before it reads the
folder, held until that process ends (the kernel releases it however the process ends: a
kill -9 leaves no stale lock). The launcher checks the folder before it starts any rank. Two
jobs saving into one folder at once each replaced the other's steps, and both exited 0.
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat
from pathlib import Path
from typing import IO

from autopart.errors import AutopartError

LOCK = ".autopart.lock"  # in a checkpoint folder: flock'ed by the run that saves there


def claim(root: str | Path) -> IO[str]:
    """Take the checkpoint folder ``root`` (made if missing) for this process: an exclusive
    ``flock`` on ``root/.autopart.lock``, which records this process's id and host. Returns the
    open lock file: the folder is this run's while it stays open, and the kernel releases the
    lock when the process ends, however it ends. A folder another live run holds is refused,
    naming it (two jobs on one folder each replaced the other's steps, silently). Rank 0 of
    ``autopart run --checkpoint-dir`` and ``autopart train`` calls it before its first read."""
    root = Path(root)
    path = root / LOCK
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(
            path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644
        )
    except OSError as exc:
        raise AutopartError(
            f"cannot open the checkpoint folder's lock {path}: {exc.strerror or exc}",
            hint="the folder must be writable and its .autopart.lock a plain file",
        ) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)  # a FIFO, a device, or a hard link to a file elsewhere: never written
        raise AutopartError(
            f"the checkpoint folder's lock {path} is "
            + ("not a regular file" if not stat.S_ISREG(st.st_mode) else "a hard link")
            + ": autopart writes its process id there, and will not write through it",
            hint="remove it (autopart makes a new one), or give this run another folder",
        )
    f = os.fdopen(fd, "r+")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = f.read(200).strip() or "another process"
        f.close()
        raise AutopartError(
            f"the checkpoint folder {root} is in use by another run ({holder})",
            hint="give this run its own checkpoint folder, or wait for that run to end",
        ) from None
    f.truncate(0)
    f.write(f"process {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f


def check_free(root: str | Path) -> None:
    """Refuse the checkpoint folder ``root`` if another run holds it (``claim``), before
    anything is launched; holds nothing itself (rank 0 claims it)."""
    if os.path.lexists(Path(root) / LOCK):  # (a FIFO or a link there is refused, not skipped)
        claim(root).close()
