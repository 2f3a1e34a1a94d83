"""The job token sealed to one recipient's ephemeral key, so that it can travel over a channel a passive listener
reads (Ray's calls between the launcher and a task's actor, which carry arguments in clear without Ray's TLS).

The recipient (a task's actor) makes an X25519 key pair when it is created and hands out its public key
(``Opener.public_key``). The sender makes a fresh X25519 key pair per message, derives a key from the shared secret
with HKDF-SHA256 (bound to both public keys) and encrypts the token with ChaCha20-Poly1305 (``seal``); the
recipient derives the same key and decrypts (``Opener.open``). What crosses the wire is two public keys, a nonce
and a ciphertext: a listener that reads all of it learns nothing of the token, and the private keys never leave
their processes. Why this and not a token file or Ray's TLS: a Ray cluster's nodes share no file system by
default, and Ray's TLS (``RAY_USE_TLS``) is a setting of the cluster that the launcher cannot switch on for a
cluster it joins; the key exchange needs neither. It does not authenticate the actor: an active attacker on Ray's
channels could put its own key in its place, but one who can speak to a Ray cluster can run code on its nodes
anyway (Ray's own authentication or TLS is what keeps it out).

The primitives are the ``cryptography`` package's (a dependency of ``tensorfleet[ray]``), imported when first used.
"""

from __future__ import annotations

import os
from typing import Any

from tensorfleet.errors import ConfigError

INFO = b"tensorfleet/token-to-actor/v1"  # HKDF's context: a key derived here is for this use only
NONCE_BYTES = 12
INSTALL_HINT = "pip install 'tensorfleet[ray]'"


def _primitives() -> tuple[Any, Any, Any, Any, Any]:
    """(X25519PrivateKey, X25519PublicKey, ChaCha20Poly1305, HKDF, hashes) from ``cryptography``.

    Raises:
        ConfigError: ``cryptography`` is not installed.
    """
    try:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
        from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    except ImportError as exc:
        raise ConfigError(f"--backend ray needs the 'cryptography' package to hand the job token to its tasks "
                          f"without sending it in clear, and it cannot be imported ({exc}): {INSTALL_HINT}") from None
    return X25519PrivateKey, X25519PublicKey, ChaCha20Poly1305, HKDF, hashes


def require() -> None:
    """Raise ConfigError now, with the way out, if sealing cannot work here."""
    _primitives()


def _raw(public_key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _key(private_key: Any, peer: bytes, sender: bytes, recipient: bytes) -> bytes:
    """The message key: HKDF-SHA256 of the X25519 shared secret, bound to both public keys."""
    _, public_class, _, hkdf, hashes = _primitives()
    shared = private_key.exchange(public_class.from_public_bytes(peer))
    return hkdf(algorithm=hashes.SHA256(), length=32, salt=None, info=INFO + sender + recipient).derive(shared)


def seal(secret: str, recipient: str) -> dict[str, str]:
    """``secret`` encrypted for the holder of the private key of ``recipient`` (a public key, hex): what may cross
    the wire."""
    private_class, _, aead, _, _ = _primitives()
    mine = private_class.generate()
    sender, target = _raw(mine.public_key()), bytes.fromhex(recipient)
    nonce = os.urandom(NONCE_BYTES)
    box = aead(_key(mine, target, sender, target)).encrypt(nonce, secret.encode(), INFO)
    return {"sender": sender.hex(), "nonce": nonce.hex(), "box": box.hex()}


class Opener:
    """A recipient's ephemeral key pair: its public key to hand out, and ``open`` for what was sealed to it."""

    def __init__(self) -> None:
        private_class = _primitives()[0]
        self._private = private_class.generate()
        self._public = _raw(self._private.public_key())

    def public_key(self) -> str:
        return self._public.hex()

    def open(self, sealed: dict[str, str]) -> str:
        """The secret of a ``seal`` to this key.

        Raises:
            ValueError: it was not sealed to this key, or it was altered on the way.
        """
        _, _, aead, _, _ = _primitives()
        try:
            sender, nonce, box = (bytes.fromhex(sealed[k]) for k in ("sender", "nonce", "box"))
            return aead(_key(self._private, sender, sender, self._public)).decrypt(nonce, box, INFO).decode()
        except Exception as exc:  # noqa: BLE001 - InvalidTag, a malformed key or field: one answer
            raise ValueError(f"the sealed token cannot be opened with this key ({type(exc).__name__})") from None
