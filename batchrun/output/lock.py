"""One writer per output folder: an exclusive flock on OUTPUT/_lock while a run (or a merge) writes.

The file holds the holder's record (host, pid, start, command), emptied on release; the kernel drops a dead
holder's flock; the file is never removed (two runs could lock two files of one name). Where flock fails, the
record decides: a live process on this host refuses the run, any other record is overwritten with a warning."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchrun.output.files import WriteFailure

log = logging.getLogger(__name__)

LOCK_FILE = "_lock"
_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


class OutputBusy(Exception):
    """Another process holds the output folder (exit 2: nothing was touched)."""


@dataclass
class Holder:
    host: str
    pid: int
    since: str  # local time the holder took the lock
    command: str

    @classmethod
    def me(cls, command: str | None = None) -> Holder:
        return cls(host=socket.gethostname(), pid=os.getpid(), since=time.strftime("%Y-%m-%d %H:%M:%S %z"),
                   command=command or " ".join(["batchrun", *sys.argv[1:]])[:200])

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            d: dict[str, Any] = json.loads(text)
            return cls(host=str(d["host"]), pid=int(d["pid"]), since=str(d["since"]), command=str(d["command"]))
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, since {self.since} ({self.command})"

    def alive_here(self) -> bool | None:
        """True / False for a process on this host; None when it is on another host (cannot be checked)."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process
            return True
        return True


def in_use(folder: Path) -> str | None:
    """Who holds `folder`, if a process does (None: free, or never locked); takes nothing and writes nothing."""
    path = Path(folder) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = Holder.parse(os.read(fd, 4096).decode("utf-8", "replace"))
        return holder.describe() if holder else "a process whose record is empty"
    except OSError:
        return None  # no flock on this filesystem: nothing to tell
    finally:
        os.close(fd)
    return None


class OutputLock:
    """`with OutputLock(folder, what):` holds folder/_lock, or raises OutputBusy. Never open the file another way
    meanwhile: where a flock is a POSIX lock (NFS), closing any descriptor of it drops the lock."""

    def __init__(self, folder: Path, what: str = "run") -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self.what = what  # for messages: "run", "merge"
        self.fd: int | None = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def acquire(self) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # for writing: NFS needs it for LOCK_EX
        except OSError as e:
            raise WriteFailure(self.path, e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputBusy(self._busy_message(self._read_holder())) from None
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                os.close(fd)
                raise
            self._without_flock(fd, e)
        self.fd = fd
        self._write_record(Holder.me())

    def release(self) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            os.ftruncate(fd, 0)  # the record describes a live holder only
        except OSError:
            pass
        os.close(fd)  # drops the flock

    # ------------------------------------------------------------ internals

    def _read_holder(self) -> Holder | None:
        try:
            with open(self.path, encoding="utf-8") as f:
                return Holder.parse(f.read())
        except OSError:
            return None

    def _busy_message(self, holder: Holder | None) -> str:
        where = f"{self.folder} is in use by another batchrun"
        if holder is None:
            return f"{where} (its record in {self.path} is empty); wait for it to end or stop it"
        if holder.alive_here() is False:
            return (f"{where}: {holder.describe()}, which is no longer running, but the filesystem still holds "
                    f"its lock (an NFS server that has not yet noticed); wait a few minutes, or remove {self.path} "
                    "once you are sure nothing writes the folder")
        return f"{where}: {holder.describe()}; wait for it to end or stop it"

    def _without_flock(self, fd: int, error: OSError) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        holder = Holder.parse(os.read(fd, 4096).decode("utf-8", "replace"))
        if holder is not None and holder.pid != os.getpid():
            alive = holder.alive_here()
            if alive:
                os.close(fd)
                raise OutputBusy(self._busy_message(holder))
            if alive is None:
                log.warning("%s names another run (%s) that cannot be checked from this host; taking the folder",
                            self.path, holder.describe())
        log.warning("cannot lock %s (%s): this filesystem has no flock, so a second %s on another host would "
                    "not be stopped (docs/durability.md)", self.path, os.strerror(error.errno), self.what)

    def _write_record(self, holder: Holder) -> None:
        data = (json.dumps(holder.__dict__) + "\n").encode()
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, data, 0)
            os.fsync(self.fd)
        except OSError as e:  # the lock holds without its record; a second run then only says less
            log.warning("could not write %s: %s", self.path, os.strerror(e.errno) if e.errno else e)
