"""``vitgraph encode --out``: the output path checked before anything loads, and written
atomically."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from .checkpoints.files import save_atomically


def check_out(out: str, inputs: list[Path], force: bool) -> Path:
    """The output path, checked before anything is loaded: a regular file or a new one (never a
    link, a device or a FIFO: the write would replace it), not an input, in a writable folder,
    and not overwriting a file unless ``force``."""
    if out.endswith(("/", os.sep, "/.", "/..")):  # Path() would drop the slash and write a file
        raise ValueError(f"--out {out}: names a directory; give a file path")
    path = Path(out).expanduser()
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as err:
        raise ValueError(f"--out {out}: cannot be checked ({err.strerror})") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise ValueError(f"--out {out}: is a directory; give a file path")
    if mode is not None and stat.S_ISLNK(mode):
        raise ValueError(f"--out {out}: is a symbolic link; give the file itself")
    if mode is not None and not stat.S_ISREG(mode):
        raise ValueError(f"--out {out}: is not a regular file (a device, a FIFO or a socket)")
    for source in inputs:
        if path.resolve() == source.resolve() or (mode is not None and source.exists() and path.samefile(source)):
            raise ValueError(f"--out {out}: is one of the input images; it would be overwritten")
    folder = path.resolve().parent
    if not folder.is_dir():
        raise ValueError(f"--out {out}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--out {out}: folder {folder} is not writable")
    if mode is not None and not force:
        raise ValueError(f"--out {out}: exists; pass --force to overwrite it")
    return path


def check_out_is_not_the_checkpoint(out: Path, model: str) -> None:
    """Refuse an ``out`` anywhere inside a folder the checkpoint is read from (its folder, or a
    Hub repo's cache folder: snapshots and blobs), whether or not the file exists yet: a new
    file there (a preprocessor_config.json, say) changes what loads next time."""
    from .checkpoints.loading import find_checkpoint

    files = find_checkpoint(model)
    target = out.resolve()
    snapshot = files.config.parent.resolve()
    root = snapshot.parent.parent if snapshot.parent.name == "snapshots" else snapshot  # the Hub repo's cache
    if root == target or root in target.parents:
        raise ValueError(f"--out {out}: is inside the folder of the checkpoint {model} ({root}), which vitgraph "
                         "reads; write elsewhere")
    if any(target == p.resolve() or (out.exists() and out.samefile(p)) for p in files.paths()):
        raise ValueError(f"--out {out}: is a file of the checkpoint {model}; it would be overwritten")


_IO_SIGNS = ("No space left", "Disk quota", "IoError", "os error", "Input/output error", "Read-only file system")


def write_atomically(tensors: dict, out: Path, metadata: dict) -> None:
    """Write through a temporary file in ``out``'s folder, then rename it over ``out``: a failed
    write (a full disk) leaves the old file as it was, and is one ValueError naming ``out``."""
    from safetensors import SafetensorError

    existed = out.exists()
    try:
        old_mode = stat.S_IMODE(os.stat(out).st_mode) if existed else 0o644
        save_atomically(tensors, out.resolve().parent / out.name, metadata, mode=old_mode, suffix=".tmp")
    except BaseException as err:
        # safetensors reports a full disk as a SafetensorError (an IoError inside), not an OSError
        if isinstance(err, (OSError, SafetensorError)) or (isinstance(err, Exception) and _names_io(err)):
            what = getattr(err, "strerror", None) or _io_message(err)
            kept = "left as it was" if existed else "not written"
            raise ValueError(f"--out {out}: could not be written ({what}); {kept}") from None
        raise


def _names_io(err: Exception) -> bool:
    return any(sign in str(err) for sign in _IO_SIGNS)


def _io_message(err: Exception) -> str:
    """The OS's words where the text wraps them (safetensors: ``IoError(Os { ..., message: "..." })``)."""
    text = str(err)
    found = re.search(r'message: "([^"]*)"', text)
    return found.group(1) if found else (text.splitlines() or [type(err).__name__])[0]
