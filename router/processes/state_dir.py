"""The private folder of a router's processes (0700, in /dev/shm where there is one): the local sockets,
the load table and prometheus_client's multiprocess files.

The parent holds an flock on the folder's `lock` file while it lives. A parent killed before its cleanup
(SIGKILL) leaves the folder behind; the next router's start removes every such folder of this user whose
lock nobody holds. A lock, not a pid: containers that share /dev/shm (`--ipc=host`) do not share pids.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile

PREFIX = "pdsdk-router-"
LOCK = "lock"


def open_state_dir(base: str | None = None) -> tuple[str, int]:
    """A new folder and the fd that holds its lock (close it after removing the folder)."""
    base = base or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    remove_stale(base)
    path = tempfile.mkdtemp(prefix=PREFIX, dir=base)
    # Locked under another name, then renamed: a sweeper never sees `lock` unlocked while we live.
    fd = os.open(os.path.join(path, ".lock"), os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(os.path.join(path, ".lock"), os.path.join(path, LOCK))
    return path, fd


def remove_stale(base: str) -> list[str]:
    """Remove this user's router folders in `base` whose lock nobody holds; returns their paths.
    A folder without a lock file (one being made, or an older router's) is left alone."""
    gone = []
    for entry in os.scandir(base):
        if not entry.name.startswith(PREFIX):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            fd = os.open(os.path.join(entry.path, LOCK), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: its router lives
        finally:
            os.close(fd)
        shutil.rmtree(entry.path, ignore_errors=True)
        gone.append(entry.path)
    return gone
