"""Bounded reads of regular files named by a path (image files, JSON configs), and the atomic
write of a safetensors file. Standard library only at import, so that any layer may import it."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def read_regular_file(path: str | os.PathLike, max_bytes: int, what: str) -> bytes:
    """The bytes of ``path``, a regular file of at most ``max_bytes``, or a ValueError naming it.
    ``what`` names the file expected (``"an image file"``) in the errors about a directory and
    a size. Checked on the opened file itself, opened non-blocking, so that a FIFO (or a file
    swapped for one after any check) never blocks; at most ``max_bytes + 1`` bytes are read, so
    a file that grows while read is refused too."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:  # missing, or a dangling link
        raise ValueError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: is a directory, not {what}") from None
    except (OSError, ValueError) as err:  # ValueError: a NUL byte in the path
        raise ValueError(f"{str(path)!r}: cannot be read ({getattr(err, 'strerror', None) or err})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # checked before fdopen, which refuses a directory itself
        os.close(fd)
        kind = f"is a directory, not {what}" if stat.S_ISDIR(info.st_mode) else "is not a regular file"
        raise ValueError(f"{path}: {kind}")
    if info.st_size > max_bytes:
        os.close(fd)
        raise ValueError(f"{path}: is {info.st_size} bytes; {what} must be at most {max_bytes}")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(max_bytes + 1)
        except OSError as err:
            raise ValueError(f"{path}: cannot be read ({err.strerror or err})") from None
    if len(data) > max_bytes:
        raise ValueError(f"{path}: grew past the {max_bytes}-byte limit while read")
    return data


def save_atomically(tensors: dict, target: Path, metadata: dict, *, mode: int, suffix: str) -> None:
    """Write ``tensors`` as safetensors to a temporary file beside ``target`` (named ``.NAME.*SUFFIX``),
    fsync it, give it ``mode`` and rename it over ``target``: a reader sees the whole file or the
    old one. On any failure the temporary file is removed and the error raised as it came."""
    from safetensors.torch import save_file

    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=suffix)
    os.close(fd)
    try:
        save_file(tensors, name, metadata=metadata)
        with open(name, "rb") as f:
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.chmod(name, mode)
        os.replace(name, target)
    except BaseException:
        os.unlink(name)
        raise
