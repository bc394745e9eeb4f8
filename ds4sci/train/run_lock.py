"""One run at a time per run folder: the lock ``train.out_dir/.ds4sci.lock`` that every command writing a run folder
(a new run, ``--resume``, ``--overwrite``) takes before it reads or writes anything there, and holds to its end.

Why ``flock``: the kernel releases the lock when its holder dies, however it dies (``kill -9``, out of memory, a
lost node's process killed by the scheduler), so a crashed run never leaves the folder stuck: a lock is held exactly
while a live process holds it, and stale as soon as its holder is gone, with no pid to check against a process table
(a pid means nothing on another host, and is reused on this one). The file holds the holder's host, pid, command and
start time, so a refusal names the live process, and taking over a stale lock names the run that left it. A holder's
children that inherited the open file (``fork`` without ``exec``) hold the lock with it until they exit too.

The file is removed by the release at the end of a run, and at the exit of a process that still holds it (an error
stopped the run: ``atexit``); a process killed leaves it, stale, taken over by the next run with a warning that names
the killed one. It is never part of the run: ``--overwrite`` deletes everything else of the folder while holding it.

Across hosts the lock holds where the filesystem propagates ``flock``: local disks (one host), NFS (the Linux client
emulates ``flock`` with POSIX locks that the server arbitrates; not under the ``nolock`` or ``local_lock=flock``
mount options, whose locks are node-local), Lustre mounted with ``flock`` (``localflock``: node-local), GPFS.
Where the filesystem refuses ``flock`` (Lustre mounted without either option: ``ENOSYS``; NFS without a lock
manager: ``ENOLCK``; ``EOPNOTSUPP``), refusing would make ds4sci unusable there, so the run goes on unlocked after
one warning that names the folder and the filesystem.

Within one process the lock is re-entrant: a second :func:`lock_run_dir` of a folder this process holds shares the
lock (a process is one holder: it may build a second trainer on its own folder), released with the last holder.
"""
from __future__ import annotations

import atexit
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_FILE = ".ds4sci.lock"
#: ``flock`` errors that mean the filesystem cannot lock, not that another process holds the lock.
UNSUPPORTED = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)

_held: dict[str, RunLock] = {}  # this process's locks, by the folder's resolved path


class RunLock:
    """The lock of one run folder, held by this process (:func:`lock_run_dir`)."""

    def __init__(self, folder: Path, key: str, fd: int, created: bool):
        self.folder, self.path = folder, folder / LOCK_FILE
        self._key, self._fd, self._created, self._holders = key, fd, created, 1

    def release(self) -> None:
        """Let go of this holder's share; the last one removes the lock file (while still holding the lock, so no
        other process can lock the file being removed: one that opened it before finds it gone and takes a new one),
        and the folder too when this lock created it and it is empty (a refused launch leaves nothing behind)."""
        self._holders -= 1
        if self._holders:
            return
        del _held[self._key]
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        if self._created:
            try:
                self.folder.rmdir()
            except OSError:  # not empty: the run wrote there, or another run took the folder meanwhile
                pass


@atexit.register
def _release_at_exit() -> None:
    """Release what this process still holds as it exits (a run stopped by an error), so only a killed run leaves
    its lock file behind."""
    for lock in list(_held.values()):
        lock._holders = 1
        lock.release()


def _describe(record: dict) -> str:
    return (f"pid {record.get('pid', '?')} on host {record.get('host', '?')} ({record.get('command', '?')}, started "
            f"{record.get('started', '?')})")


def _read_record(fd: int) -> dict | None:
    """The holder record in the lock file open as ``fd``; None when it is empty or unreadable (a holder that has
    not written it yet, or a file damaged by a crash)."""
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def filesystem(path: Path) -> str:
    """The type and mount point of the filesystem that holds ``path`` (from ``/proc/self/mountinfo``), such as
    ``lustre mounted at /lus``; ``an unknown filesystem`` where that cannot be read."""
    target, best = os.path.realpath(path), None
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return "an unknown filesystem"
    for line in lines:
        fields, _, rest = line.partition(" - ")
        mount_point, fs_type = fields.split()[4], rest.split()[0]
        if target == mount_point or target.startswith(mount_point.rstrip("/") + "/"):
            if best is None or len(mount_point) > len(best[0]):
                best = (mount_point, fs_type)
    return f"{best[1]} mounted at {best[0]}" if best else "an unknown filesystem"


def lock_run_dir(folder: Path, command: str) -> RunLock | None:
    """Lock the run folder ``folder`` (created, with its parents, if missing) for this process, without waiting, and
    write the holder record (host, pid, ``command``, start time) into the lock file.

    Returns:
        the lock, to :meth:`~RunLock.release` when the run ends; None when the filesystem cannot lock (warned).
    Raises:
        ValueError: another live process holds the lock (one line naming the folder and the holder).
        OSError: the folder or its lock file cannot be created (naming the path).
    """
    folder = Path(folder)
    key = str(folder.resolve())
    if key in _held:
        _held[key]._holders += 1
        return _held[key]
    path = folder / LOCK_FILE
    while True:
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            folder.mkdir()
            created = True
        except FileExistsError:
            created = False
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            record = _read_record(fd)
            os.close(fd)
            holder = _describe(record) if record else "another process (it has not written its record yet)"
            raise ValueError(f"train.out_dir {folder} is in use by {holder}: wait for it to finish, or choose another "
                             f"train.out_dir (its lock: {path})") from None
        except OSError as err:
            os.close(fd)
            if err.errno not in UNSUPPORTED:
                raise
            logger.warning("train.out_dir %s is on %s, which cannot lock files (flock: %s): this run goes on "
                           "unlocked, so nothing stops a second run from writing into it", folder,
                           filesystem(folder), os.strerror(err.errno))
            return None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder released (removed) the file between our open and our lock: lock the new one
    stale = _read_record(fd)
    if stale:
        logger.warning("train.out_dir %s: took over the lock left by %s, which is no longer running", folder,
                       _describe(stale))
    record = {"host": socket.gethostname(), "pid": os.getpid(), "command": command,
              "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode() + b"\n", 0)
    lock = _held[key] = RunLock(folder, key, fd, created)
    return lock
