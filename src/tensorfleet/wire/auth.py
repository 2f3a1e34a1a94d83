"""The job's shared secret: every call between tasks carries it, every task refuses calls without it.

``tensorfleet launch`` makes a new random token per job and gives it to its tasks in
the environment (``TENSORFLEET_TOKEN``), never on a command line where ``ps`` would
show it; ``TENSORFLEET_TOKEN_FILE`` names a file holding it instead (a Kubernetes
Secret mounted as a file, say).  A task with no token configured accepts every
call, as a cluster started by hand on a trusted machine does; with one, every gRPC call
carries a proof in its metadata (``call_proof``: an HMAC under the token of the method, the
task it is for, the time, a fresh nonce and a digest of the request; accepted within
``CALL_WINDOW_S`` of the task's clock, each nonce once, by that task only, for that request only)
and each data-plane connection must open with a challenge and response (``Hello``, ``Prove``) that
proves the token on both sides without sending it: each side sends a random nonce and answers with
an HMAC under the token of its direction, the task the connection is for, and both nonces
(``proof``), so a listener on the path, or a task that is not the job's, learns nothing it could
replay, and a proof made for one task (or one direction) opens nothing at another: a process that
took a dead task's port cannot relay a live task's proofs. A client checks the server's proof
first and never proves itself to a server that failed it.  Comparisons take constant time;
refusals are counted, malformed proofs included.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import re
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


# A call proof: <unix time>.<nonce>.<request digest>.<HMAC>, ASCII only (str.isdigit takes '²' for a digit).
_CALL_PROOF = re.compile(r"([0-9]{1,12})\.([0-9a-f]{%d})\.([0-9a-f]{64})\.([0-9a-f]{64})" % NONCE_CHARS)


def proof(token: str, role: str, task: str, first: str, second: str) -> str:
    """HMAC-SHA256 under the token of (role, task, both nonces): what a side sends instead of the token.

    ``role`` ("server", "client" or "call") keeps one direction's proof from being replayed as the
    other's; ``task`` (the full name of the task the connection or call is for, ``/job:ps/task:1``)
    keeps a proof made for one task from opening anything at another.
    """
    message = f"tensorfleet-hello/{role}/{task}/{first}/{second}".encode()
    return hmac.new(token.encode(), message, "sha256").hexdigest()


def request_digest(request: bytes) -> str:
    """SHA-256 of a gRPC request's bytes: a call proof covers the request it came with, not any other."""
    return hashlib.sha256(request).hexdigest()


def call_proof(token: str, method: str, task: str, request: bytes, *, now: float | None = None) -> str:
    """What a gRPC call to ``task`` carries instead of the token: ``<unix time>.<nonce>.<request digest>.<HMAC
    of method, task, time, nonce and digest>``."""
    stamp, nonce, digest = int(time.time() if now is None else now), new_nonce(), request_digest(request)
    return f"{stamp}.{nonce}.{digest}.{proof(token, 'call', task, method, f'{stamp}/{nonce}/{digest}')}"


def call_digest(presented: object) -> str | None:
    """The request digest a well-formed call proof names (None for anything else)."""
    match = _CALL_PROOF.fullmatch(presented) if isinstance(presented, str) else None
    return match.group(3) if match else None


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
    """A task's check of the token: ``admits(presented)``, with a count of refusals.

    Args:
        token: the job's token; None: no check (a cluster by hand on a trusted machine).
        task: the full name of the task this gate guards (``/job:ps/task:0``): proofs are bound to it.
    """

    def __init__(self, token: str | None, task: str = "") -> None:
        self.task = task
        self._token = token.encode() if token else None
        self._lock = threading.Lock()
        self.refused = 0
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()  # nonce -> time, for replays

    def check_guards(self, task: str) -> "Gate":
        """This gate, after checking it guards ``task``: proofs are bound to a task's name, so a server whose
        gate names another task would refuse every caller. Raises ValueError."""
        if self.required and self.task != task:
            raise ValueError(f"the gate guards {self.task!r}, not {task!r}: proofs are bound to the task's name")
        return self

    @property
    def required(self) -> bool:
        return self._token is not None

    def proof(self, role: str, first: str, second: str) -> str:
        """This task's proof (see ``proof``), bound to its own name; only for a gate that requires a token."""
        assert self._token is not None
        return proof(self._token.decode(), role, self.task, first, second)

    def admits_proof(self, presented: object, role: str, first: str, second: str) -> bool:
        """True if ``presented`` is the proof of (role, this task, first, second) under the token; else a counted
        refusal."""
        if self._token is not None and isinstance(presented, str) and presented.isascii() \
                and hmac.compare_digest(presented.encode(), self.proof(role, first, second).encode()):
            return True
        self.refuse()
        return False

    def refuse(self) -> None:
        """Count a refusal (a proof that failed, a request that is not the one its proof covers)."""
        with self._lock:
            self.refused += 1

    def admits_call(self, presented: object, method: str) -> bool:
        """A gRPC call's proof (``call_proof``) for ``method`` at this task: well formed, right HMAC, within the
        window, nonce not seen before. True when no token is required; anything else is a counted refusal.
        The request digest it names is checked against the request once it is read (``admits_request``)."""
        if self._token is None:
            return True
        now = time.time()
        match = _CALL_PROOF.fullmatch(presented) if isinstance(presented, str) else None
        if match is not None:
            stamp, nonce, digest, mac = match.groups()
            if abs(now - int(stamp)) <= CALL_WINDOW_S and hmac.compare_digest(
                    mac.encode(), self.proof("call", method, f"{stamp}/{nonce}/{digest}").encode()):
                with self._lock:
                    while self._seen and (len(self._seen) >= MAX_SEEN_NONCES
                                          or next(iter(self._seen.values())) < now - 2 * CALL_WINDOW_S):
                        self._seen.popitem(last=False)
                    if nonce not in self._seen:
                        self._seen[nonce] = now
                        return True
        self.refuse()
        return False

    def admits_request(self, presented: object, request: bytes) -> bool:
        """True if the call proof ``presented`` (already admitted) names this request's digest, or no token is
        required; else a counted refusal: a proof copied onto another request opens nothing."""
        if self._token is None:
            return True
        digest = call_digest(presented)
        if digest is not None and hmac.compare_digest(digest, request_digest(request)):
            return True
        self.refuse()
        return False

    def admits(self, presented: object) -> bool:
        """True for the right token (or when none is required); anything else is a counted refusal."""
        if self._token is None:
            return True
        if isinstance(presented, str):
            presented = presented.encode()
        if isinstance(presented, bytes) and hmac.compare_digest(presented, self._token):
            return True
        self.refuse()
        return False
