"""Routes with TLS (`up --lan --route-tls-cert/--route-tls-key/--route-tls-ca`): two real nats-servers on
loopback, certificates made here with the `openssl` command. A server whose certificate another CA signed
gets no route."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from helpers.harness import free_port, until_sync

from jetshard.up.natsserver import ClusterSettings, NatsServer, RouteTls, start_nats_server


def make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    key, cert = directory / f"{name}-ca.key", directory / f"{name}-ca.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name} CA",
         "-keyout", key, "-out", cert],
        check=True, capture_output=True,
    )  # fmt: skip
    return key, cert


def make_cert(directory: Path, name: str, ca: tuple[Path, Path]) -> tuple[Path, Path]:
    key, request, cert = directory / f"{name}.key", directory / f"{name}.csr", directory / f"{name}.pem"
    extensions = directory / f"{name}.ext"
    extensions.write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    subprocess.run(
        ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", key, "-out", request],
        check=True, capture_output=True,
    )  # fmt: skip
    subprocess.run(
        ["openssl", "x509", "-req", "-in", request, "-CA", ca[1], "-CAkey", ca[0], "-CAcreateserial", "-days", "1",
         "-extfile", extensions, "-out", cert],
        check=True, capture_output=True,
    )  # fmt: skip
    return key, cert


def routes_of(monitor_port: int) -> set[str]:
    """The servers this one has routes to (NATS pools several connections per pair)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/routez", timeout=5) as response:
        return {r["remote_name"] for r in json.load(response).get("routes") or []}


def test_routes_use_tls_and_refuse_a_certificate_of_another_ca(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make certificates")
    ca, stranger_ca = make_ca(tmp_path, "cluster"), make_ca(tmp_path, "stranger")
    route_ports = [free_port() for _ in range(3)]
    servers: list[NatsServer] = []
    monitors = [free_port() for _ in range(3)]
    try:
        for n, (name, signer) in enumerate((("a", ca), ("b", ca), ("c", stranger_ca))):
            key, cert = make_cert(tmp_path, name, signer)
            cluster = ClusterSettings(
                name="tls-test",
                server_name=name,
                listen_host="127.0.0.1",
                route_port=route_ports[n],
                secret="the-cluster-secret",
                routes=tuple(f"127.0.0.1:{p}" for i, p in enumerate(route_ports) if i != n),
                jetstream=False,
                tls=RouteTls(cert, key, signer[1]),
            )
            servers.append(
                start_nats_server(
                    tmp_path / name,
                    port=-1,
                    log_file=tmp_path / f"{name}.log",
                    cluster=cluster,
                    monitor_port=monitors[n],
                )
            )
        until_sync(
            lambda: routes_of(monitors[0]) == {"b"}, 30, lambda: f"a's route to b, a has {routes_of(monitors[0])}"
        )
        assert routes_of(monitors[0]) == {"b"} and routes_of(monitors[1]) == {"a"}
        # The stranger's route attempts refused, not merely pending.
        stranger_log = tmp_path / "c.log"
        until_sync(
            lambda: "tls route handshake error" in stranger_log.read_text().lower(),
            30,
            lambda: f"the stranger's routes refused:\n{stranger_log.read_text()[-2000:]}",
        )
        assert routes_of(monitors[2]) == set() and "c" not in routes_of(monitors[0])
        assert "tls" in (tmp_path / "c.log").read_text().lower()
    finally:
        for server in servers:
            server.stop()
