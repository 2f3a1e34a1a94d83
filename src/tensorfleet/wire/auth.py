"""The job's shared secret: every call between tasks carries it, every task refuses calls without it.

``tensorfleet launch`` makes a new random token per job and gives it to its tasks in
the environment (``TENSORFLEET_TOKEN``), never on a command line where ``ps`` would
show it; ``TENSORFLEET_TOKEN_FILE`` names a file holding it instead (a Kubernetes
Secret mounted as a file, say).  A task with no token configured accepts every
call, as a cluster started by hand on a trusted machine does; with one, every gRPC call
carries a proof in its metadata (``call_proof``: an HMAC under the token of the method, the
time and a fresh nonce; accepted within ``CALL_WINDOW_S`` of the task's clock, each nonce once)
and each data-plane connection must open with a
challenge and response (``Hello``, ``Prove``) that proves the token on both sides without
sending it: each side sends a random nonce and answers with an HMAC of both nonces under the
token (``proof``), so a listener on the path, or a task that is not the job's, learns nothing
it could replay.  Comparisons take constant time; refusals are counted.
"""

from __future__ import annotations

import collections
import hmac
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Mapping

from tensorfleet.errors import ConfigError

TOKEN_ENV = "TENSORFLEET_TOKEN"
TOKEN_FILE_ENV = "TENSORFLEET_TOKEN_FILE"
METADATA_KEY = "x-tensorfleet-token"  # gRPC metadata keys are lowercase


NONCE_CHARS = 32  # hex of 128 random bits
CALL_WINDOW_S = 300  # a gRPC call's proof is accepted this long either side of the task's clock
MAX_SEEN_NONCES = 200_000  # proofs remembered (for the window) to refuse a replay


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


def call_proof(token: str, method: str, *, now: float | None = None) -> str:
    """What a gRPC call carries instead of the token: ``<unix time>.<nonce>.<HMAC of method, time, nonce>``."""
    stamp, nonce = int(time.time() if now is None else now), new_nonce()
    return f"{stamp}.{nonce}.{proof(token, 'call', method, f'{stamp}/{nonce}')}"


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
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()  # nonce -> time, for replays

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

    def admits_call(self, presented: object, method: str) -> bool:
        """A gRPC call's proof (``call_proof``) for ``method``: right HMAC, within the window, nonce not seen
        before. True when no token is required; anything else is a counted refusal."""
        if self._token is None:
            return True
        now = time.time()
        if isinstance(presented, str) and presented.count(".") == 2:
            stamp, nonce, mac = presented.split(".")
            if stamp.isdigit() and is_nonce(nonce) and abs(now - int(stamp)) <= CALL_WINDOW_S and hmac.compare_digest(
                    mac.encode(), self.proof("call", method, f"{stamp}/{nonce}").encode()):
                with self._lock:
                    while self._seen and (len(self._seen) >= MAX_SEEN_NONCES
                                          or next(iter(self._seen.values())) < now - 2 * CALL_WINDOW_S):
                        self._seen.popitem(last=False)
                    if nonce not in self._seen:
                        self._seen[nonce] = now
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
