"""Who may use the job service: users with hashed passwords, browser sessions with their CSRF token,
and API tokens for the CLI; in the service's database (tables ``users`` and ``tokens``).

Passwords are hashed with scrypt (``hashlib.scrypt``, memory-hard; parameters stored with each hash,
so they can be raised later). Session and API tokens are 256-bit random strings handed out once;
the database keeps only their SHA-256, so a copy of it opens no session. A password check costs
~50 ms of CPU on purpose: ``check_password`` lets at most ``MAX_CONCURRENT_CHECKS`` run at a time
and answers "busy" beyond that, so a stranger hammering the login form cannot occupy the machine; and
wrong passwords slow down the next sign-in of the name and of the client (``guard``, see ``guard.py``).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
from dataclasses import dataclass

from tensorfleet.errors import ConfigError, TensorfleetError
from tensorfleet.service.guard import SignInGuard
from tensorfleet.service.store import JobStore

SCRYPT_N, SCRYPT_R, SCRYPT_P = 2 ** 14, 8, 1
MIN_PASSWORD_LENGTH = 8
SESSION_TTL_S = 12 * 3600.0
MAX_CONCURRENT_CHECKS = 2
USER_PATTERN = re.compile(r"^[a-z_][a-z0-9_.-]{0,31}$")


class TooBusyError(TensorfleetError):
    """Too many password checks at once: try again in a moment."""

    code = "RESOURCE_EXHAUSTED"


@dataclass(frozen=True)
class User:
    name: str
    admin: bool


@dataclass(frozen=True)
class Session:
    user: User
    csrf: str | None  # None for an API token: it is not a cookie, so no other site can send it


def hash_password(password: str, *, salt: bytes | None = None) -> str:
    salt = salt if salt is not None else secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, dklen=32)
    return f"scrypt${SCRYPT_N}${SCRYPT_R}${SCRYPT_P}${salt.hex()}${digest.hex()}"


def password_matches(password: str, stored: str) -> bool:
    try:
        scheme, n, r, p, salt, digest = stored.split("$")
        if scheme != "scrypt":
            return False
        candidate = hashlib.scrypt(password.encode(), salt=bytes.fromhex(salt), n=int(n), r=int(r), p=int(p),
                                   dklen=len(digest) // 2)
    except (ValueError, MemoryError):
        return False
    return hmac.compare_digest(candidate.hex(), digest)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


# Checked against when the user does not exist, so that an unknown name costs as long as a wrong password.
_UNKNOWN_USER_HASH = hash_password("", salt=b"\0" * 16)


class Accounts:
    """Users, sessions and API tokens in ``store``'s database."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self._checks = threading.BoundedSemaphore(MAX_CONCURRENT_CHECKS)
        self.guard = SignInGuard()  # wrong passwords slow the next sign-in of the name and of the client

    # ----- users

    def add_user(self, name: str, password: str, *, admin: bool = False) -> User:
        if not USER_PATTERN.match(name or ""):
            raise ConfigError(f"user name {name!r} is not valid: lowercase letters, digits, '_', '.', '-' "
                              f"(at most 32, starting with a letter)")
        _check_password(password)
        with self.store.write() as conn:
            if conn.execute("SELECT 1 FROM users WHERE name = ?", (name,)).fetchone():
                raise ConfigError(f"user {name!r} exists already: set a new password with "
                                  f"'tensorfleet users passwd {name}'")
            conn.execute("INSERT INTO users (name, password, admin, created_at) VALUES (?, ?, ?, ?)",
                         (name, hash_password(password), int(admin), self.store.now()))
        return User(name, admin)

    def set_password(self, name: str, password: str) -> None:
        """A new password; every session of the user ends (API tokens stay)."""
        _check_password(password)
        with self.store.write() as conn:
            if conn.execute("UPDATE users SET password = ? WHERE name = ?",
                            (hash_password(password), name)).rowcount != 1:
                raise ConfigError(f"no user {name!r}")
            conn.execute("DELETE FROM tokens WHERE user = ? AND kind = 'session'", (name,))

    def users(self) -> list[User]:
        with self.store.read() as conn:
            return [User(name, bool(admin)) for name, admin in
                    conn.execute("SELECT name, admin FROM users ORDER BY name").fetchall()]

    def has_users(self) -> bool:
        return bool(self.users())

    def check_password(self, name: str, password: str) -> User | None:
        """The user if ``password`` is theirs, else None. Raises TooBusyError when too many checks run."""
        if not self._checks.acquire(blocking=False):
            raise TooBusyError("too many sign-ins at once: try again in a second")
        try:
            with self.store.read() as conn:
                row = conn.execute("SELECT password, admin FROM users WHERE name = ?", (name,)).fetchone()
            matches = password_matches(password, row[0] if row else _UNKNOWN_USER_HASH)
            return User(name, bool(row[1])) if row and matches else None
        finally:
            self._checks.release()

    # ----- sessions and tokens

    def new_session(self, user: User, ttl_s: float = SESSION_TTL_S) -> tuple[str, str]:
        """A browser session: (its cookie value, its CSRF token)."""
        token, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
        now = self.store.now()
        with self.store.write() as conn:
            conn.execute("DELETE FROM tokens WHERE kind = 'session' AND expires_at < ?", (now,))
            conn.execute("INSERT INTO tokens (digest, user, kind, csrf, created_at, expires_at) "
                         "VALUES (?, ?, 'session', ?, ?, ?)", (_digest(token), user.name, csrf, now, now + ttl_s))
        return token, csrf

    def new_api_token(self, name: str) -> str:
        """A token for the CLI and the JSON API (``Authorization: Bearer TOKEN``); shown once."""
        token = "tfs_" + secrets.token_urlsafe(32)
        with self.store.write() as conn:
            if not conn.execute("SELECT 1 FROM users WHERE name = ?", (name,)).fetchone():
                raise ConfigError(f"no user {name!r}")
            conn.execute("INSERT INTO tokens (digest, user, kind, created_at) VALUES (?, ?, 'api', ?)",
                         (_digest(token), name, self.store.now()))
        return token

    def session(self, token: str | None, kind: str) -> Session | None:
        """Who holds ``token`` (a session cookie or an API token), or None if it is unknown or expired."""
        if not token or len(token) > 200:
            return None
        with self.store.read() as conn:
            row = conn.execute(
                "SELECT t.user, u.admin, t.csrf, t.expires_at FROM tokens t JOIN users u ON u.name = t.user "
                "WHERE t.digest = ? AND t.kind = ?", (_digest(token), kind)).fetchone()
        if row is None or (row[3] is not None and row[3] < self.store.now()):
            return None
        return Session(User(row[0], bool(row[1])), row[2])

    def end_session(self, token: str) -> None:
        with self.store.write() as conn:
            conn.execute("DELETE FROM tokens WHERE digest = ? AND kind = 'session'", (_digest(token),))


def _check_password(password: str) -> None:
    if not isinstance(password, str) or len(password) < MIN_PASSWORD_LENGTH:
        raise ConfigError(f"a password needs at least {MIN_PASSWORD_LENGTH} characters")
