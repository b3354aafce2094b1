"""A service session's TLS identity, and TLS 1.3 contexts that admit exactly the certificates the cluster vouches for.

Each session (a worker's, for the tunnels between ranks: `jetshard_worker.peer_tunnel`; a downloader's, for its file
server: `jetshard_downloader.file_server`) makes a fresh self-signed identity (`PeerIdentity.create`); the
certificates' PEMs travel through the cluster's authenticated event log (a node reports only about itself), so each
side knows the certificates its peer may present. Those certificates are a context's only trust anchors, which pins
them: a certificate verifies only if it is an anchor itself or was signed by an anchor's key, and OpenSSL refuses the
latter: the anchor is CA:FALSE, without keyCertSign. Either way only the holder of a pinned key gets in.
"""

from __future__ import annotations

import datetime
import os
import secrets
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Valid from an hour ago, so that a peer whose clock is a little behind accepts a certificate made just now.
CERTIFICATE_BACKDATE = datetime.timedelta(hours=1)
CERTIFICATE_LIFETIME = datetime.timedelta(days=30)


@dataclass(frozen=True)
class PeerIdentity:
    """A worker session's TLS identity: its self-signed certificate (PEM, to publish to peers) and the files that
    `ssl.SSLContext.load_cert_chain` reads."""

    certificate_pem: str
    certificate_path: Path
    key_path: Path

    @classmethod
    def create(cls, directory: Path, name: str) -> PeerIdentity:
        """Make a fresh ECDSA P-256 key and a self-signed certificate for it, written to `directory` as `name.crt`
        and `name.key` (0600: the key is the worker's word that it is who it says).

        P-256, not Ed25519: both work in TLS 1.3 with OpenSSL 3, but P-256 is the curve every TLS stack supports.
        The certificate is a plain leaf (CA:FALSE); OpenSSL accepts a self-signed leaf as its own trust anchor, so it
        needs no CA bit, and a CA:FALSE certificate cannot be used to vouch for another."""
        if not name or name in (".", "..") or "/" in name or "\0" in name:
            raise ValueError(f"an identity's name must be a plain file name, not {name!r}")
        key = ec.generate_private_key(ec.SECP256R1())
        # A name of its own per session: OpenSSL finds a trust anchor by its subject, so a context that trusts two
        # sessions of one node (a downloader restarted) must not find the other session's certificate first.
        session = secrets.token_hex(8)
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"jetshard {name} {session}")])
        now = datetime.datetime.now(datetime.UTC)
        certificate = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CERTIFICATE_BACKDATE)
            .not_valid_after(now + CERTIFICATE_LIFETIME)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            # Each rank is a server to some peers and a client of others, with the one certificate.
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        directory.mkdir(parents=True, exist_ok=True)
        key_path = directory / f"{name}.key"
        # Created 0600 rather than chmod-ed after: the key is never readable by others, not even for a moment.
        descriptor = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as key_file:
            os.fchmod(key_file.fileno(), 0o600)  # a file left by an earlier session keeps its mode through O_CREAT
            key_file.write(
                key.private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                )
            )
        certificate_pem = certificate.public_bytes(serialization.Encoding.PEM).decode("ascii")
        certificate_path = directory / f"{name}.crt"
        certificate_path.write_text(certificate_pem)
        return cls(certificate_pem=certificate_pem, certificate_path=certificate_path, key_path=key_path)


def server_context(identity: PeerIdentity, allowed_peer_pem: str) -> ssl.SSLContext:
    """The context of `serve_peer`: TLS 1.3, presents `identity`, and requires a client certificate that is exactly
    `allowed_peer_pem` (the context trusts that certificate alone)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _harden(context, identity, allowed_peer_pem, "allowed_peer_pem")
    return context


def client_context(identity: PeerIdentity, server_pem: str) -> ssl.SSLContext:
    """The context of `forward_to_peer`: TLS 1.3, presents `identity`, and accepts only a server that presents
    exactly `server_pem`. The host name is not checked: the pinned certificate, not a name, says who the peer is."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    _harden(context, identity, server_pem, "server_pem")
    return context


def _harden(context: ssl.SSLContext, identity: PeerIdentity, peer_pem: str, argument: str) -> None:
    peer_certificate = _single_certificate(peer_pem, argument)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_cert_chain(identity.certificate_path, identity.key_path)
    context.load_verify_locations(cadata=peer_certificate.public_bytes(serialization.Encoding.DER))


def _single_certificate(pem: str, argument: str) -> x509.Certificate:
    """The one certificate in `pem`: a pin is one certificate, and a bundle would trust each of its members."""
    try:
        certificates = x509.load_pem_x509_certificates(pem.encode("ascii"))
    except (ValueError, UnicodeEncodeError) as error:
        raise ValueError(f"{argument} is not a PEM certificate: {error}") from None
    if len(certificates) != 1:
        raise ValueError(f"{argument} must hold exactly one certificate, not {len(certificates)}")
    return certificates[0]


def server_context_for_any(identity: PeerIdentity, allowed_pems: Iterable[str]) -> ssl.SSLContext:
    """A server context like `server_context` that admits any one of `allowed_pems` (each a single certificate);
    `trust` adds more later. One that is not valid PEM is skipped: it comes from a peer's report."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_cert_chain(identity.certificate_path, identity.key_path)
    trust(context, allowed_pems)
    return context


def trust(context: ssl.SSLContext, pems: Iterable[str]) -> None:
    """Add each of `pems` (a single certificate each; others skipped) to the certificates `context` admits."""
    for pem in pems:
        try:
            certificate = _single_certificate(pem, "certificate")
        except ValueError:
            continue
        context.load_verify_locations(cadata=certificate.public_bytes(serialization.Encoding.DER))


def certificate_der(pem: str) -> bytes | None:
    """The DER form of the single certificate in `pem` (what `getpeercert(binary_form=True)` gives), or None."""
    try:
        return _single_certificate(pem, "certificate").public_bytes(serialization.Encoding.DER)
    except ValueError:
        return None
