"""The job's shared secret: every call between tasks carries it, every task refuses calls without it.

``tensorfleet launch`` makes a new random token per job and gives it to its tasks in
the environment (``TENSORFLEET_TOKEN``), never on a command line where ``ps`` would
show it; ``TENSORFLEET_TOKEN_FILE`` names a file holding it instead (a Kubernetes
Secret mounted as a file, say).  A task with no token configured accepts every
call, as a cluster started by hand on a trusted machine does; with one, gRPC calls
must carry it as metadata and each data-plane connection must open with a
challenge and response (``Hello``, ``Prove``) that proves the token on both sides without
sending it: each side sends a random nonce and answers with an HMAC of both nonces under the
token (``proof``), so a listener on the path, or a task that is not the job's, learns nothing
it could replay.  Comparisons take constant time; refusals are counted.
"""

from __future__ import annotations

import hmac
import os
import secrets
import threading
from pathlib import Path
from typing import Mapping

from tensorfleet.errors import ConfigError

TOKEN_ENV = "TENSORFLEET_TOKEN"
TOKEN_FILE_ENV = "TENSORFLEET_TOKEN_FILE"
METADATA_KEY = "x-tensorfleet-token"  # gRPC metadata keys are lowercase


NONCE_CHARS = 32  # hex of 128 random bits


def new_nonce() -> str:
    return secrets.token_hex(NONCE_CHARS // 2)


def is_nonce(value: object) -> bool:
    return isinstance(value, str) and len(value) == NONCE_CHARS and all(c in "0123456789abcdef" for c in value)


def proof(token: str, role: str, first: str, second: str) -> str:
    """HMAC-SHA256 under the token of (role, both nonces): what a side sends instead of the token.

    ``role`` ("server" or "client") keeps one side's proof from being replayed as the other's.
    """
    message = f"tensorfleet-hello/{role}/{first}/{second}".encode()
    return hmac.new(token.encode(), message, "sha256").hexdigest()


def new_token() -> str:
    """A fresh job token: 256 random bits, hex."""
    return secrets.token_hex(32)


def job_token(environ: Mapping[str, str] = os.environ) -> str | None:
    """This task's token from ``TENSORFLEET_TOKEN`` or the file ``TENSORFLEET_TOKEN_FILE`` names; None: no auth."""
    token = environ.get(TOKEN_ENV)
    if token:
        return token
    path = environ.get(TOKEN_FILE_ENV)
    if path:
        try:
            token = Path(path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"{TOKEN_FILE_ENV}={path!r} cannot be read: {exc.strerror}") from None
        if not token:
            raise ConfigError(f"{TOKEN_FILE_ENV}={path!r} is empty: it must hold the job's token")
        return token
    return None


class Gate:
    """A server's check of the token: ``admits(presented)``, with a count of refusals."""

    def __init__(self, token: str | None) -> None:
        self._token = token.encode() if token else None
        self._lock = threading.Lock()
        self.refused = 0

    @property
    def required(self) -> bool:
        return self._token is not None

    def proof(self, role: str, first: str, second: str) -> str:
        """This side's proof (see ``proof``); only for a gate that requires a token."""
        assert self._token is not None
        return proof(self._token.decode(), role, first, second)

    def admits_proof(self, presented: object, role: str, first: str, second: str) -> bool:
        """True if ``presented`` is the proof of (role, first, second) under the token; else a counted refusal."""
        if self._token is not None and isinstance(presented, str) \
                and hmac.compare_digest(presented.encode(), self.proof(role, first, second).encode()):
            return True
        with self._lock:
            self.refused += 1
        return False

    def admits(self, presented: object) -> bool:
        """True for the right token (or when none is required); anything else is a counted refusal."""
        if self._token is None:
            return True
        if isinstance(presented, str):
            presented = presented.encode()
        if isinstance(presented, bytes) and hmac.compare_digest(presented, self._token):
            return True
        with self._lock:
            self.refused += 1
        return False
