"""Optional TLS on the gRPC channels: certificates from files; a plaintext client cannot talk to a TLS task."""

import shutil
import subprocess

import pytest
import torch

from tensorfleet.errors import ConfigError, UnavailableError
from tensorfleet.ps.api import OptimizerSpec
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.wire.rpc import Channel, TlsFiles, WireOptions
from tensorfleet.worker.client import PsClient

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> TlsFiles:
    """A CA and a certificate for 127.0.0.1 signed by it, made with the openssl command."""
    d = tmp_path_factory.mktemp("tls")

    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=tensorfleet test CA")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "task.key", "-out", "task.csr", "-subj", "/CN=127.0.0.1")
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "task.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "task.pem", "-days", "2", "-extfile", "san.cnf")
    return TlsFiles(cert=str(d / "task.pem"), key=str(d / "task.key"), ca=str(d / "ca.pem"))


def test_a_ps_with_tls_serves_tls_clients_and_refuses_plaintext_ones(certificates):
    tls = WireOptions(tls=certificates, token=None)
    with ps_servers(num_ps=1, num_workers=1, options=tls) as (cluster, servers):
        client = PsClient(cluster, {"w": 0}, options=tls)
        try:
            client.wait_for_shards(10)
            assert client.initialize({"w": torch.zeros(3)}, OptimizerSpec.sgd(lr=1.0))  # Init went over TLS
            assert client.push({"w": torch.ones(3)}).global_step == 1
        finally:
            client.close()
        plaintext = Channel(cluster.ps_addresses[0], task="ps:0", options=WireOptions(tls=None, token=None))
        try:
            with pytest.raises(UnavailableError):
                plaintext.call("Status", timeout=3)
        finally:
            plaintext.close()


def test_tls_settings_come_from_the_environment_all_or_none(certificates):
    assert TlsFiles.from_env({}) is None
    env = {"TENSORFLEET_TLS_CERT": certificates.cert, "TENSORFLEET_TLS_KEY": certificates.key,
           "TENSORFLEET_TLS_CA": certificates.ca}
    assert TlsFiles.from_env(env) == certificates
    with pytest.raises(ConfigError, match="missing TENSORFLEET_TLS_CA"):
        TlsFiles.from_env({k: v for k, v in env.items() if k != "TENSORFLEET_TLS_CA"})
    with pytest.raises(ConfigError, match="cannot be read"):
        TlsFiles(cert="/nonexistent.pem", key=certificates.key, ca=certificates.ca).server_credentials()
