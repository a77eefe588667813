"""The endpoint picker's TLS, as gateways dial it: ``kvroute epp`` serves TLS by default with a self-signed
certificate made at start (kgateway and Envoy AI Gateway dial TLS without verifying; Istio does with a
``DestinationRule`` ``tls.mode: SIMPLE, insecureSkipVerify``), a mounted certificate and key when given (and the
new pair after the files change), and plaintext h2c only with ``--grpc-insecure``. The gateway stand-in
(``loadtest/epp_gateway.py``) fetches the certificate the picker presents and trusts it, as such a gateway does."""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loadtest.epp_gateway import GatewayStream, channel_for, fetch_certificate, stub_for
from router.epp.tls import KeyPair, self_signed, write_pair
from tests.helpers import Proc, free_port, wait_until
from tests.integration.test_epp_protocol import MODEL, Fleet, _engine, start_epp


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    proc, port = _engine(11)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


def _body(prompt: str) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2}).encode()


def _health(channel: grpc.Channel) -> int:
    resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
    return int(resp.status)


def _routes(f: Fleet, engine: str) -> None:
    """A request through the picker, on a new connection, is routed and its answer passes back."""
    _, stub = stub_for(f.grpc_port, tls=f.tls)
    s = GatewayStream(stub)
    picked = s.request("/v1/completions", _body("over tls " * 10))
    assert picked.immediate is None and picked.endpoint == engine.removeprefix("http://")
    out = s.relay_response(picked.endpoint, "/v1/completions", picked.body)
    s.close()
    assert json.loads(out)["usage"]["completion_tokens"] == 2


def test_the_picker_serves_tls_by_default_with_a_self_signed_certificate(engine: str) -> None:
    f = start_epp([engine], ready=1)
    try:
        cert = x509.load_pem_x509_certificate(fetch_certificate("127.0.0.1", f.grpc_port))
        assert cert.issuer == cert.subject  # self-signed, made at start
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert "localhost" in san.get_values_for_type(x509.DNSName)
        _routes(f, engine)
        tls = channel_for(f.grpc_port)
        assert _health(tls) == health_pb2.HealthCheckResponse.SERVING
        tls.close()
        # a client dialing plaintext h2c gets no service: the port speaks TLS only
        plain = channel_for(f.grpc_port, tls=False)
        with pytest.raises(grpc.RpcError):
            _health(plain)
        plain.close()
    finally:
        f.router.stop()


def test_grpc_insecure_serves_plaintext_only(engine: str) -> None:
    f = start_epp([engine], ready=1, tls=False)
    try:
        plain = channel_for(f.grpc_port, tls=False)
        assert _health(plain) == health_pb2.HealthCheckResponse.SERVING
        plain.close()
        _routes(f, engine)
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            fetch_certificate("127.0.0.1", f.grpc_port)  # no TLS handshake on a plaintext port
    finally:
        f.router.stop()


def _mount(pair: KeyPair, directory: Path) -> None:
    """Replace the mounted files at once, as a Secret volume update does (a new directory, renamed in)."""
    staging = directory.parent / f"{directory.name}.new"
    staging.mkdir()
    write_pair(pair, staging)
    for name in ("epp-tls.crt", "epp-tls.key"):
        os.replace(staging / name, directory / name)
    staging.rmdir()


def test_a_mounted_certificate_is_served_and_its_rotation_picked_up(engine: str, tmp_path: Path) -> None:
    mounted = tmp_path / "tls"
    mounted.mkdir()
    first, second = self_signed(["localhost"]), self_signed(["localhost"])
    _mount(first, mounted)
    f = start_epp(
        [engine],
        "--epp-tls-cert-file",
        str(mounted / "epp-tls.crt"),
        "--epp-tls-key-file",
        str(mounted / "epp-tls.key"),
        ready=1,
    )
    try:
        assert fetch_certificate("127.0.0.1", f.grpc_port).strip() == first.cert_pem.strip()
        _routes(f, engine)
        _mount(second, mounted)  # the Secret was renewed: new connections get the new certificate
        wait_until(
            lambda: fetch_certificate("127.0.0.1", f.grpc_port).strip() == second.cert_pem.strip(),
            timeout=10,
            what="the rotated certificate served",
        )
        _routes(f, engine)  # a new connection trusting the new certificate
        assert f.router.alive()
    finally:
        f.router.stop()


@pytest.mark.parametrize("case", ["key_of_another_certificate", "certificate_without_key"])
def test_a_bad_mounted_pair_stops_the_picker_at_start_with_a_clear_error(case: str, tmp_path: Path) -> None:
    cert, _ = write_pair(self_signed(["localhost"]), tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    _, other_key = write_pair(self_signed(["localhost"]), other)
    flags = ["--epp-tls-cert-file", str(cert)]
    if case == "key_of_another_certificate":
        flags += ["--epp-tls-key-file", str(other_key)]
    proc = Proc.kvroute(
        "epp",
        "--port",
        str(free_port()),
        "--grpc-port",
        str(free_port()),
        "--tokenizer-mode",
        "bytes",
        *flags,
    )
    try:
        wait_until(lambda: not proc.alive(), timeout=30, what="kvroute epp refusing to start")
        out = proc.output()
        assert proc.popen.returncode == 2, out
        expected = "is not the private key" if case == "key_of_another_certificate" else "go together"
        assert expected in out, out
        assert "Traceback" not in out
    finally:
        proc.stop()
