"""Throw-away TLS files for tests and benchmarks: a CA and a certificate for 127.0.0.1 signed by it."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tensorfleet.wire.rpc import TlsFiles


def make_certificates(directory: Path) -> TlsFiles:
    """A CA and a task certificate for 127.0.0.1 and localhost in ``directory``, made with the openssl command."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=tensorfleet test CA")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "task.key", "-out", "task.csr", "-subj", "/CN=127.0.0.1")
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "task.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "task.pem", "-days", "2", "-extfile", "san.cnf")
    return TlsFiles(cert=str(directory / "task.pem"), key=str(directory / "task.key"), ca=str(directory / "ca.pem"))
