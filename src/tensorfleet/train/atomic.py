"""Files written whole or not at all, in a directory nobody else can write to.

A save writes a temporary file and renames it over the target, so a reader sees the old file or
the new one. The temporary file is made with ``O_CREAT|O_EXCL|O_NOFOLLOW`` under a random name: a
predictable name (``.checkpoint.json.tmp-<pid>``) let anyone who could write the directory plant a
symlink there and make a save overwrite a file elsewhere. A directory that other users may write to
is refused outright, before anything in it is read or written: in it they could still swap files
under a reader. "Other users" are everyone but its owner (this user, or root): the group and every
user through the mode bits, and anyone a POSIX ACL (``system.posix_acl_access``) lets write.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import struct
from pathlib import Path

from tensorfleet.errors import ConfigError

ACL_XATTR = "system.posix_acl_access"
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_GROUP, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_ACL_HEADER, _ACL_ENTRY = struct.Struct("<I"), struct.Struct("<HHI")
_NO_ACL = {errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP}
WRITE, READ = 0o2, 0o4  # permission bits, as an ACL entry and each class of the mode hold them


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


def acl_grants(target: int | str | Path, permission: int = WRITE) -> list[str] | None:
    """Who but the owner the access ACL of ``target`` (a path or an open descriptor) lets ``permission``
    (``WRITE``/``READ``: 2, 4), as phrases ("user 1001", "group 27", "its group", "every user"); None without an
    ACL (the mode bits then say it all).

    The mask bounds named users and groups and the owning group: an entry the mask denies grants nothing (and
    with an ACL, the mode's group bits are that mask, not what the group may do).
    """
    try:
        raw = os.getxattr(target, ACL_XATTR)
    except OSError as exc:
        if exc.errno in _NO_ACL:
            return None
        raise
    entries = [_ACL_ENTRY.unpack_from(raw, offset) for offset in range(_ACL_HEADER.size, len(raw), _ACL_ENTRY.size)
               if offset + _ACL_ENTRY.size <= len(raw)]
    mask = next((perm for tag, perm, _ in entries if tag == _ACL_MASK), 0o7)
    named = {_ACL_USER: "user {}", _ACL_GROUP: "group {}", _ACL_GROUP_OBJ: "its group", _ACL_OTHER: "every user"}
    grants = []
    for tag, perm, ident in entries:
        if tag not in named or (tag == _ACL_USER and ident == os.geteuid()):
            continue
        effective = perm if tag == _ACL_OTHER else perm & mask
        if effective & permission:
            grants.append(named[tag].format(ident))
    return grants


def others_may(info: os.stat_result, target: int | str | Path, permission: int = WRITE) -> str | None:
    """Why users other than the owner may ``permission`` (``WRITE``, ``READ``) the file ``info`` describes (open as
    ``target``), as a phrase ("its group (gid 27) can write it (mode 775)"), or None: by its ACL where it has one,
    else by the group and other bits of its mode."""
    verb = "write" if permission == WRITE else "read"
    grants = acl_grants(target, permission)
    if grants is not None:
        return f"an ACL lets {', '.join(grants)} {verb} it" if grants else None
    mode = stat.S_IMODE(info.st_mode)
    if mode & permission:
        return f"every user can {verb} it (mode {mode:o})"
    if mode & (permission << 3):
        return f"its group (gid {info.st_gid}) can {verb} it (mode {mode:o})"
    return None


def private_directory_problem(directory: int | str | Path) -> str | None:
    """What lets users other than this one (and root) write to ``directory`` (a path or an open descriptor), as
    a phrase, or None if nobody else can."""
    info = os.stat(directory)
    if info.st_uid not in (os.geteuid(), 0):
        return f"it belongs to another user (uid {info.st_uid})"
    return others_may(info, directory)


CHECKPOINT_RISK = "another user could swap a checkpoint under a reader or make a save overwrite a file elsewhere"


def check_private_directory(directory: Path, what: str = "checkpoint directory", risk: str = CHECKPOINT_RISK) -> None:
    """Raise ConfigError naming ``what`` is wrong with ``directory``, the ``risk``, and what to run, if users other
    than this one (and root) may write to it."""
    problem = private_directory_problem(directory)
    if problem is None:
        return
    fix = ("use a folder of your own" if problem.startswith("it belongs") else
           f"run 'chmod go-w {directory}'" + (f" and 'setfacl -b {directory}'" if "ACL" in problem else "") +
           ", or use a folder of your own")
    raise ConfigError(f"{what} {directory} is not private: {problem}; {risk}: {fix}")


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole: a fresh temporary file beside it (never an existing name, never through a
    link), flushed to disk, renamed over ``path``, and the rename flushed too; the mode is the usual one
    (0666 less the umask)."""
    check_private_directory(path.parent)
    _replace_with_new_file(path, data, 0o666 & ~_umask())


def write_private_file(path: Path, data: bytes, *, what: str, risk: str) -> None:
    """Write ``data`` to ``path`` as ``write_atomically`` does, readable and writable by this user only (0600),
    in a directory only this user can write (a secret, such as a job token, or what points at one); ConfigError
    for another directory (``what`` it is, the ``risk``)."""
    check_private_directory(path.parent, what, risk)
    _replace_with_new_file(path, data, 0o600)


def _replace_with_new_file(path: Path, data: bytes, mode: int) -> None:
    """A new file of ``mode`` under a random name beside ``path`` (``O_EXCL|O_NOFOLLOW``: never a file or link
    someone made), ``data`` flushed to disk, renamed over ``path``; the rename flushed too."""
    directory = path.parent
    descriptor, temporary = _new_file(directory, f".{path.name}.tmp-")
    try:
        with os.fdopen(descriptor, "wb") as handle:
            os.fchmod(handle.fileno(), mode)
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    directory_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(directory_fd)  # the rename itself must survive a crash
    finally:
        os.close(directory_fd)


def _new_file(directory: Path, prefix: str) -> tuple[int, Path]:
    """A file that did not exist, made now under an unpredictable name (mode 0600 until the caller sets it)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        temporary = directory / f"{prefix}{secrets.token_hex(8)}"
        try:
            return os.open(temporary, flags, 0o600), temporary
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary name in {directory} after 100 tries")
