"""Files written whole or not at all, in a directory nobody else can write to.

A save writes a temporary file and renames it over the target, so a reader sees the old file or
the new one. The temporary file is made with ``O_CREAT|O_EXCL`` under a random name
(``tempfile.mkstemp``): a predictable name (``.checkpoint.json.tmp-<pid>``) let anyone who could
write the directory plant a symlink there and make a save overwrite a file elsewhere. A directory
that other users may write to (world-writable, or another user's) is refused outright: in it they
could still swap files under a reader.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from tensorfleet.errors import ConfigError


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it, racing other threads)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def check_private_directory(directory: Path) -> None:
    """Raise ConfigError if users other than this one (and root) may write to ``directory``."""
    info = os.stat(directory)
    others_write = bool(info.st_mode & stat.S_IWOTH)
    foreign = info.st_uid not in (os.geteuid(), 0)
    if others_write or foreign:
        why = (f"is writable by every user (mode {stat.S_IMODE(info.st_mode):o})" if others_write else
               f"belongs to another user (uid {info.st_uid})")
        raise ConfigError(f"checkpoint directory {directory} {why}: another user could make a save overwrite a "
                          f"file elsewhere or swap a checkpoint under a reader; use a directory only you (and your "
                          f"group) can write (chmod o-w, or a folder of your own)")


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole: a fresh temporary file beside it (never an existing name, never through a
    link), flushed to disk, renamed over ``path``, and the rename flushed too; the mode is the usual one
    (0666 less the umask)."""
    directory = path.parent
    check_private_directory(directory)
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.tmp-")
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), 0o666 & ~_umask())
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    directory_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(directory_fd)  # the rename itself must survive a crash
    finally:
        os.close(directory_fd)
