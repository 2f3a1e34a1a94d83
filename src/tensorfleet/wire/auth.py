"""The job's shared secret: every call between tasks carries a proof of it, every task refuses calls without one.

``tensorfleet launch`` makes a new random token per job and gives it to its tasks in
the environment (``TENSORFLEET_TOKEN``), never on a command line where ``ps`` would
show it; ``TENSORFLEET_TOKEN_FILE`` names a file holding it instead (a Kubernetes
Secret mounted as a file, say).  A task with no token configured accepts every
call, as a cluster started by hand on a trusted machine does.  With one, both sides prove the token without
sending it, and the server proves itself first:

* every task has a random **incarnation** (``Gate.incarnation``), new each time it starts;
* a gRPC client opens each connection with ``Hello``: it sends a fresh nonce, the server answers its
  incarnation and ``server_proof`` (an HMAC under the token of role "server", the task, the nonce and the
  incarnation). A client sends no body to, and believes nothing from, a server that fails it;
* every later call carries ``call_proof``: an HMAC of the method, the task it is for, the time, a fresh nonce,
  the server's incarnation and a digest of the request; accepted within ``CALL_WINDOW_S`` of the task's clock,
  each nonce once, by that task only, in that incarnation only (a recorded proof opens nothing at the task
  restarted), for that request only;
* each data-plane connection opens with a challenge and response (``Hello``, ``Prove``): each side sends a random
  nonce and answers with an HMAC under the token of its direction, the task the connection is for, both nonces
  and (the server's) its incarnation (``proof``). The client checks the server's proof first and never proves
  itself to a server that failed it.

So a listener on the path, or a process that is not the job's, learns nothing it could replay, and a proof made
for one task, direction or incarnation opens nothing at another: a process that took a dead task's port cannot
relay a live task's proofs.  Comparisons take constant time; refusals are counted, malformed proofs included.
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
HELLO_KEY = "x-tensorfleet-hello"  # a gRPC Hello's nonce: in the metadata, so no request body is ever read for it


NONCE_CHARS = 32  # hex of 128 random bits
CALL_WINDOW_S = 300  # a gRPC call's proof is accepted this long either side of the task's clock
MAX_SEEN_NONCES = 200_000  # proofs remembered (for the window) to refuse a replay


def new_nonce() -> str:
    return secrets.token_hex(NONCE_CHARS // 2)


def is_nonce(value: object) -> bool:
    return isinstance(value, str) and len(value) == NONCE_CHARS and all(c in "0123456789abcdef" for c in value)


def new_incarnation() -> str:
    """A task's incarnation: random, new each time a task starts, so that no proof outlives the process it was for."""
    return new_nonce()


# A call proof: <unix time>.<nonce>.<incarnation>.<request digest>.<HMAC>, ASCII only (str.isdigit takes '²' for a
# digit).
_CALL_PROOF = re.compile(r"([0-9]{1,12})\.([0-9a-f]{%d})\.([0-9a-f]{%d})\.([0-9a-f]{64})\.([0-9a-f]{64})"
                         % (NONCE_CHARS, NONCE_CHARS))


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


def server_proof(token: str, task: str, client_nonce: str, incarnation: str) -> str:
    """What a server answers a gRPC ``Hello`` with: ``proof`` of role "server", the task, the client's nonce and
    the server's incarnation. The incarnation is written ``incarnation/<hex>``, never a bare nonce, so this proof
    never passes for a data connection's server proof (whose nonces the data client checks are bare hex)."""
    return proof(token, "server", task, client_nonce, f"incarnation/{incarnation}")


def proves_server(token: str, task: str, client_nonce: str, incarnation: object, presented: object) -> bool:
    """A client's check of a gRPC ``Hello`` answer, in constant time: ``presented`` is the ``server_proof`` of
    ``task`` holding the token, for our ``client_nonce``, in ``incarnation`` (a well-formed one)."""
    if not (is_nonce(incarnation) and isinstance(presented, str) and presented.isascii()):
        return False
    assert isinstance(incarnation, str)
    return hmac.compare_digest(presented.encode(), server_proof(token, task, client_nonce, incarnation).encode())


def call_proof(token: str, method: str, task: str, request: bytes, *, incarnation: str,
               now: float | None = None) -> str:
    """What a gRPC call to ``task`` carries instead of the token: ``<unix time>.<nonce>.<incarnation>.<request
    digest>.<HMAC of method, task, time, nonce, incarnation and digest>``; ``incarnation`` is the server's, as its
    ``Hello`` proved it."""
    stamp, nonce, digest = int(time.time() if now is None else now), new_nonce(), request_digest(request)
    signed = f"{stamp}/{nonce}/{incarnation}/{digest}"
    return f"{stamp}.{nonce}.{incarnation}.{digest}.{proof(token, 'call', task, method, signed)}"


def call_digest(presented: object) -> str | None:
    """The request digest a well-formed call proof names (None for anything else)."""
    match = _CALL_PROOF.fullmatch(presented) if isinstance(presented, str) else None
    return match.group(4) if match else None


def call_incarnation(presented: object) -> str | None:
    """The incarnation a well-formed call proof names (None for anything else)."""
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

    ``incarnation`` is drawn here: one gate per task process (shared by its planes), so a restarted task has a new
    one and admits no proof made for its earlier self.
    """

    def __init__(self, token: str | None, task: str = "") -> None:
        self.task = task
        self.incarnation = new_incarnation()
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

    def hello(self, client_nonce: object) -> dict[str, str | None]:
        """The answer to a gRPC ``Hello``: this task's name, its incarnation and its ``server_proof`` for
        ``client_nonce`` (None without a token: such a task proves nothing, and a client with a token refuses it).
        Raises ValueError for a nonce that is not one (counted: a malformed proof)."""
        if self._token is None:
            return {"task": self.task, "incarnation": self.incarnation, "proof": None}
        if not is_nonce(client_nonce):
            self.refuse()
            raise ValueError("a Hello must carry a fresh nonce (32 hex digits)")
        assert isinstance(client_nonce, str)
        return {"task": self.task, "incarnation": self.incarnation,
                "proof": server_proof(self._token.decode(), self.task, client_nonce, self.incarnation)}

    def names_another_incarnation(self, presented: object) -> bool:
        """True if ``presented`` is a well-formed call proof made for another incarnation of this task (a client
        that proved an earlier process here, or a recorded proof): the refusal can say so."""
        named = call_incarnation(presented)
        return named is not None and named != self.incarnation

    def admits_call(self, presented: object, method: str) -> bool:
        """A gRPC call's proof (``call_proof``) for ``method`` at this task: well formed, naming this incarnation,
        right HMAC, within the window, nonce not seen before. True when no token is required; anything else is a
        counted refusal. The request digest it names is checked against the request once it is read
        (``admits_request``)."""
        if self._token is None:
            return True
        now = time.time()
        match = _CALL_PROOF.fullmatch(presented) if isinstance(presented, str) else None
        if match is not None:
            stamp, nonce, incarnation, digest, mac = match.groups()
            signed = f"{stamp}/{nonce}/{incarnation}/{digest}"
            if abs(now - int(stamp)) <= CALL_WINDOW_S and hmac.compare_digest(incarnation, self.incarnation) \
                    and hmac.compare_digest(mac.encode(), self.proof("call", method, signed).encode()):
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
