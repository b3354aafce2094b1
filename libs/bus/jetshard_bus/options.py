"""How a service reaches NATS. Every service takes the same options (flags `--nats`, `--nats-user`, …)."""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from jetshard_bus.inbox import inbox_prefix, public_key_of

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_API_PORT = 52415
"""The HTTP API's port: where `jetshard api` listens and where the command-line clients look for it."""
PASSWORD_VARIABLE = "JETSHARD_NATS_PASSWORD"
TOKEN_VARIABLE = "JETSHARD_NATS_TOKEN"


@dataclass(frozen=True)
class NatsOptions:
    """Connection settings for nats-py. Several `servers` form one cluster connection."""

    servers: tuple[str, ...] = (DEFAULT_NATS_URL,)
    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds_file: str | None = None
    """A `.creds` file (JWT + nkey seed) as `nsc` writes it."""
    nkey_file: str | None = None
    """A file holding an nkey seed (`jetshard up` writes one per role under `<data dir>/creds/`)."""
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    replicas: int = 1
    """Replicas of jetshard's streams and buckets when they are created; 3 on a three-server JetStream cluster."""
    placement_tag: str | None = None
    """Create streams and buckets only on servers with this tag (`jetshard up --lan` keeps them off its witness)."""
    name: str = "jetshard"
    extra: dict[str, Any] = field(default_factory=dict)

    def without_secrets(self) -> tuple[NatsOptions, dict[str, str]]:
        """These options with the password and token moved into environment variables, for a child process
        whose command line (visible to every local user in `ps`) carries the options: see `with_secrets`."""
        variables = {PASSWORD_VARIABLE: self.password, TOKEN_VARIABLE: self.token}
        secrets = {name: value for name, value in variables.items() if value is not None}
        return replace(self, password=None, token=None), secrets

    def with_secrets(self, environ: Mapping[str, str]) -> NatsOptions:
        return replace(
            self,
            password=environ.get(PASSWORD_VARIABLE, self.password),
            token=environ.get(TOKEN_VARIABLE, self.token),
        )

    def connect_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "servers": list(self.servers),
            "name": self.name,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 0.5,
            "connect_timeout": 5,
        }
        if self.user is not None:
            kwargs["user"] = self.user
            kwargs["password"] = self.password or ""
        if self.token is not None:
            kwargs["token"] = self.token
        if self.creds_file is not None:
            kwargs["user_credentials"] = self.creds_file
        if self.nkey_file is not None:
            kwargs["nkeys_seed"] = self.nkey_file
            # The only inbox jetshard's server lets this identity subscribe to (jetshard_bus.inbox).
            kwargs["inbox_prefix"] = inbox_prefix(public_key_of(Path(self.nkey_file)))
        if self.tls_ca or self.tls_cert:
            context = ssl.create_default_context(cafile=self.tls_ca)
            if self.tls_cert:
                context.load_cert_chain(self.tls_cert, self.tls_key)
            kwargs["tls"] = context
        return {**kwargs, **self.extra}
