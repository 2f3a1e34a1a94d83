"""POSIX access ACLs as ``setfacl`` writes them, for tests of the private-directory check (train/atomic.py)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

from tensorfleet.train.atomic import ACL_XATTR

_ALL = 0xFFFFFFFF  # the id field of the entries that name no user or group
_USER_OBJ, _USER, _GROUP_OBJ, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x10, 0x20


def set_access_acl(path: Path, uid: int, user_perm: int = 0o7, mask: int = 0o7) -> None:
    """``setfacl -m u:UID:PERM,m::MASK PATH``: the owner rwx, user ``uid`` ``user_perm``, the group r-x, ``mask``,
    others r-x (a directory) or r-- (a file).

    Raises:
        OSError: the file system takes no POSIX ACL.
    """
    others = 0o5 if path.is_dir() else 0o4
    entries = [(_USER_OBJ, 0o7, _ALL), (_USER, user_perm, uid), (_GROUP_OBJ, 0o5, _ALL), (_MASK, mask, _ALL),
               (_OTHER, others, _ALL)]
    os.setxattr(path, ACL_XATTR, struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries))
