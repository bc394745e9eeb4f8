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
manager: ``ENOLCK``; ``EOPNOTSUPP``), the lock file itself is the lock (one info line names the folder and the
filesystem): the holder creates it exclusively (``O_CREAT | O_EXCL``, atomic on NFS v3+ and Lustre), writes the same
record, and refreshes its modification time every :data:`HEARTBEAT_S` seconds from a thread. The file is a live
holder's unless it is stale: its time is older than :data:`STALE_S` seconds (the holder died, or its host did;
clocks of the hosts must agree to well within ``STALE_S - HEARTBEAT_S``), or it names a process of this host that
is gone. A stale file is taken over (with the warning that names its run) by renaming it aside, which one
contender wins, and creating a new one; a file that is not stale refuses the run, naming its holder, as ``flock``
does. A holder stopped for longer than ``STALE_S`` (a suspended job) can lose its lock this way.

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
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_FILE = ".ds4sci.lock"
#: ``flock`` errors that mean the filesystem cannot lock, not that another process holds the lock.
UNSUPPORTED = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)
#: Without ``flock``: seconds between two refreshes of the lock file's time by its holder.
HEARTBEAT_S = 10.0
#: Without ``flock``: a lock file whose time is older than this (seconds) is stale; 6 refreshes missed.
STALE_S = 60.0

_held: dict[str, RunLock] = {}  # this process's locks, by the folder's resolved path


class RunLock:
    """The lock of one run folder, held by this process (:func:`lock_run_dir`)."""

    def __init__(self, folder: Path, key: str, fd: int, created: bool, heartbeat: bool = False):
        self.folder, self.path = folder, folder / LOCK_FILE
        self._key, self._fd, self._created, self._holders = key, fd, created, 1
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._refresh, daemon=True, name="ds4sci-run-lock") if heartbeat else None
        if self._beat is not None:
            self._beat.start()

    def _refresh(self) -> None:
        """The heartbeat of a lock without ``flock``: the lock file's time, every :data:`HEARTBEAT_S` seconds."""
        while not self._stop.wait(HEARTBEAT_S):
            _touch(self._fd)

    def release(self) -> None:
        """Let go of this holder's share; the last one removes the lock file (while still holding the lock, so no
        other process can lock the file being removed: one that opened it before finds it gone and takes a new one),
        and the folder too when this lock created it and it is empty (a refused launch leaves nothing behind)."""
        self._holders -= 1
        if self._holders:
            return
        del _held[self._key]
        if self._beat is not None:
            self._stop.set()
            self._beat.join()
        try:
            if os.path.samestat(os.fstat(self._fd), os.stat(self.path)):  # not a file that took this one over
                self.path.unlink()
        except FileNotFoundError:
            pass
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


def _touch(fd: int) -> None:
    """Set the modification time of the file open as ``fd`` to now, by this host's clock."""
    now = time.time()
    os.utime(fd, (now, now))


def _is_stale(record: dict | None, mtime: float) -> bool:
    """Whether a lock file without ``flock`` (its ``record``, its modification time) is no live holder's: not
    refreshed for :data:`STALE_S` seconds, or naming a process of this host that is gone."""
    if time.time() - mtime > STALE_S:
        return True
    if record and record.get("host") == socket.gethostname():
        try:
            os.kill(int(record["pid"]), 0)
        except ProcessLookupError:
            return True
        except (KeyError, TypeError, ValueError, PermissionError):  # no pid to check, or another user's process
            pass
    return False


def _refusal(folder: Path, record: dict | None) -> ValueError:
    holder = _describe(record) if record else "another process (it has not written its record yet)"
    return ValueError(f"train.out_dir {folder} is in use by {holder}: wait for it to finish, or choose another "
                      f"train.out_dir (its lock: {folder / LOCK_FILE})")


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


def lock_run_dir(folder: Path, command: str) -> RunLock:
    """Lock the run folder ``folder`` (created, with its parents, if missing) for this process, without waiting, and
    write the holder record (host, pid, ``command``, start time) into the lock file.

    Returns:
        the lock, to :meth:`~RunLock.release` when the run ends (a ``flock`` lock, or where the filesystem refuses
        ``flock``, the lock file's own: see the module docstring).
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
        fd, fresh = _open_lock_file(path)
        if fd is None:
            continue  # removed between our two opens: try again
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            record = _read_record(fd)
            os.close(fd)
            raise _refusal(folder, record) from None
        except OSError as err:
            if err.errno not in UNSUPPORTED:
                os.close(fd)
                raise
            logger.info("train.out_dir %s is on %s, which cannot lock files (flock: %s): locked by its lock file "
                        "instead (a heartbeat every %.0f s)", folder, filesystem(folder), os.strerror(err.errno),
                        HEARTBEAT_S)
            fd = _lock_without_flock(folder, fd, fresh)
            return _hold(folder, key, fd, created, command, heartbeat=True)
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder released (removed) the file between our open and our lock: lock the new one
    stale = _read_record(fd)
    if stale:
        _took_over(folder, stale)
    return _hold(folder, key, fd, created, command, heartbeat=False)


def _open_lock_file(path: Path) -> tuple[int | None, bool]:
    """The lock file opened for reading and writing, and whether this call created it (exclusively); ``(None,
    False)`` when it was removed between the exclusive create and the open."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644), True
    except FileExistsError:
        pass
    try:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC), False
    except FileNotFoundError:
        return None, False


def _took_over(folder: Path, stale: dict) -> None:
    logger.warning("train.out_dir %s: took over the lock left by %s, which is no longer running", folder,
                   _describe(stale))


def _lock_without_flock(folder: Path, fd: int, fresh: bool) -> int:
    """The lock without ``flock`` (see the module docstring), from the lock file open as ``fd`` (``fresh``: created
    by this process, so already its own): returns the descriptor of the lock file this process now owns.

    Raises:
        ValueError: a live holder's lock file (naming it).
    """
    path = folder / LOCK_FILE
    while not fresh:
        record = _read_record(fd)
        if not _is_stale(record, os.fstat(fd).st_mtime):
            os.close(fd)
            raise _refusal(folder, record)
        aside = path.with_name(f"{LOCK_FILE}.stale.{socket.gethostname()}.{os.getpid()}")
        try:
            os.rename(path, aside)  # of several contenders for a stale lock, one moves it
        except FileNotFoundError:
            pass  # another contender moved it first: its new file decides below
        else:
            if os.path.samestat(os.fstat(fd), os.stat(aside)):
                if record:
                    _took_over(folder, record)
            else:  # moved another contender's new lock, not the stale one: put it back
                try:
                    os.link(aside, path)
                except FileExistsError:
                    pass
            aside.unlink()
        os.close(fd)
        fd = None
        while fd is None:
            fd, fresh = _open_lock_file(path)
    return fd


def _hold(folder: Path, key: str, fd: int, created: bool, command: str, heartbeat: bool) -> RunLock:
    """Write this process's record into the lock file open as ``fd`` (exactly it: a longer stale record's tail
    truncated) and register the lock."""
    record = {"host": socket.gethostname(), "pid": os.getpid(), "command": command,
              "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode() + b"\n", 0)
    if heartbeat:
        _touch(fd)
    lock = _held[key] = RunLock(folder, key, fd, created, heartbeat)
    return lock
