"""Every write into an output folder: whole files under a temporary name, fsynced, renamed (never half a file).
A failed write removes its temporary file and raises WriteFailure, one line naming the file and the cause."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

TMP_SUFFIX = ".batchrun-tmp"


class SinkError(RuntimeError):
    """The output cannot be written or resumed (exit 1; what is committed stays)."""


class WriteFailure(SinkError):
    def __init__(self, path: Path, error: OSError) -> None:
        self.path = Path(path)
        self.errno = error.errno
        super().__init__(f"cannot write {self.path}: {describe_os_error(error)}")


def describe_os_error(error: OSError) -> str:
    """'No space left on device (ENOSPC)': the system's words and the code a user can search for."""
    if error.errno is None:
        return str(error)
    name = errno.errorcode.get(error.errno, str(error.errno))
    return f"{os.strerror(error.errno)} ({name})"


def tmp_path(path: Path) -> Path:
    """Where `path` is written before its rename: hidden (readers of the folder skip it) and recognisable."""
    return path.with_name(f".{path.name}{TMP_SUFFIX}")


def write_bytes_atomic(path: Path, data: bytes | memoryview | Iterable[bytes]) -> None:
    """`path` holds `data` or is as it was before, also after a crash (fsync before the rename)."""
    rename_into_place(write_unrenamed(path, data), path)


def write_unrenamed(path: Path, data: bytes | memoryview | Iterable[bytes]) -> Path:
    """write_bytes_atomic's first half: `data` (or its chunks) durable under the temporary name, which is returned."""
    path = Path(path)
    tmp = tmp_path(path)
    chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) or hasattr(data, "to_pybytes") else data
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                while view:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        remove_quietly(tmp)
        raise WriteFailure(path, e) from None
    return tmp


def rename_into_place(tmp: Path, path: Path) -> None:
    """The second half: the temporary file becomes `path`, durably."""
    try:
        os.replace(tmp, path)
    except OSError as e:
        remove_quietly(tmp)
        raise WriteFailure(path, e) from None
    fsync_dir(Path(path).parent)


def write_at(path: Path, offset: int, data: bytes) -> None:
    """`data` at `offset` of `path` (an append-only file whose committed length is recorded elsewhere), the file
    cut just after it, fsynced. On failure the file is cut back to `offset` where that still works."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise WriteFailure(path, e) from None
    try:
        view, at = memoryview(data), offset
        while view:
            n = os.pwrite(fd, view, at)
            view, at = view[n:], at + n
        os.ftruncate(fd, at)
        os.fsync(fd)
    except OSError as e:
        try:
            os.ftruncate(fd, offset)
        except OSError:
            pass
        raise WriteFailure(path, e) from None
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any) -> None:
    text = json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n"
    write_bytes_atomic(path, text.encode("utf-8"))


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable; only EIO is a write failure (some filesystems cannot fsync a folder)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno == errno.EIO:
            raise WriteFailure(path, e) from None
    finally:
        os.close(fd)


def remove_file(path: Path) -> None:
    """Remove `path` if it is there; a failure to is a write failure."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise WriteFailure(path, e) from None


def remove_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
