"""What keeps a web page the user visits (or a DNS name rebound to this machine) from driving the cluster.

Browsers let any page send a "simple" cross-site request (GET, or a POST with a text/plain or form body)
without asking first, and let a rebound DNS name reach a loopback port. So every request must name an
allowed `Host`, a state-changing request must come from no foreign `Origin` and carry JSON (which a
cross-site page cannot send without a CORS preflight that we do not grant), and, when an API key is set,
every request but the health check must present it.

Ollama's routes (`/api/`) read any body as JSON, whatever its Content-Type, as Ollama does: its own examples
(`curl … -d '{…}'`) send a form's Content-Type. A browser names the page's origin on every cross-site POST, so the
Origin check still turns such a page away there.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

import psutil
from litestar.datastructures import Headers
from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, Receive, Scope, Send

from jetshard_api.errors import ApiError

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
WILDCARD_ADDRESSES = ("", "0.0.0.0", "::")
OPEN_PATHS = ("/health", "/openapi", "/dashboard/")
"""Answered without the API key: the health checks (`/health`, `/healthz`), the API's description and the
dashboard's files (a page cannot send a key before the user enters it there), and the dashboard's page `/`
itself."""
OPEN_PAGE = "/"
STATE_CHANGING_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
ANY_BODY_PATHS = "/api/"
"""Ollama's routes: their bodies are JSON whatever the Content-Type says."""


@dataclass(frozen=True)
class HttpSafety:
    api_key: str | None = None
    allowed_hosts: frozenset[str] = frozenset(LOOPBACK_HOSTS)
    """Host names and addresses (no port) a request's `Host` may name; "*" allows any."""
    cors_origins: tuple[str, ...] = ()
    """Origins (scheme://host[:port]) whose pages may call the API; none by default."""


def allowed_hosts_for(listen_host: str, extra: tuple[str, ...] = ()) -> frozenset[str]:
    """Loopback names, the address the API listens on (for a wildcard, every interface address and this
    machine's names), and `extra`."""
    hosts = {*LOOPBACK_HOSTS, _normalized(listen_host), *(_normalized(h) for h in extra)}
    if listen_host in WILDCARD_ADDRESSES:
        hosts.update(_normalized(a.address.split("%")[0]) for addrs in psutil.net_if_addrs().values() for a in addrs)
        hosts.update(_normalized(name) for name in (socket.gethostname(), socket.getfqdn()))
    return frozenset(hosts - {""})


def _normalized(host: str) -> str:
    host = host.strip().lower().removeprefix("[").removesuffix("]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host.rstrip(".")


def host_of(netloc: str) -> str:
    """The host of `host[:port]` or `[v6]:port`, normalized."""
    if netloc.startswith("["):
        return _normalized(netloc[1 : netloc.find("]")] if "]" in netloc else netloc)
    return _normalized(netloc.rsplit(":", 1)[0] if netloc.count(":") == 1 else netloc)


class HttpSafetyMiddleware(ASGIMiddleware):
    scopes = (ScopeType.HTTP,)

    def __init__(self, safety: HttpSafety) -> None:
        self.safety = safety

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        headers = Headers.from_scope(scope)
        method = scope.get("method", "GET")
        self._check_host(headers.get("host", ""))
        if method in STATE_CHANGING_METHODS:
            self._check_origin(headers.get("origin"))
        path = scope["path"]
        if method != "OPTIONS" and path != OPEN_PAGE and not path.startswith(OPEN_PATHS):  # a preflight has no key
            self._check_key(headers)
        if method in BODY_METHODS and not path.startswith(ANY_BODY_PATHS):
            _check_json(headers.get("content-type", ""))
        await next_app(scope, receive, send)

    def _check_host(self, netloc: str) -> None:
        if "*" not in self.safety.allowed_hosts and host_of(netloc) not in self.safety.allowed_hosts:
            raise ApiError(
                400,
                f"Host {netloc!r} is not one this API answers to; add it with --allowed-host",
                code="host_not_allowed",
            )

    def _check_origin(self, origin: str | None) -> None:
        if origin is None or origin in self.safety.cors_origins:
            return
        parts = urlsplit(origin)
        if parts.scheme in ("http", "https") and (
            "*" in self.safety.allowed_hosts or host_of(parts.netloc) in self.safety.allowed_hosts
        ):
            return
        raise ApiError(
            403,
            f"requests that change state are refused from the foreign origin {origin!r}; allow it with --cors-origin",
            code="origin_not_allowed",
        )

    def _check_key(self, headers: Headers) -> None:
        expected = self.safety.api_key
        if expected is None:
            return
        authorization = headers.get("authorization", "")
        scheme, _, token = authorization.partition(" ")
        presented = token.strip() if scheme.lower() == "bearer" else headers.get("x-api-key", "")
        if not hmac.compare_digest(presented.encode(), expected.encode()):
            raise ApiError(
                401,
                "missing or wrong API key; send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                code="invalid_api_key",
            )


def _check_json(content_type: str) -> None:
    media_type = content_type.partition(";")[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise ApiError(
            415,
            f"expected a JSON body (Content-Type: application/json), got {content_type or 'no Content-Type'!r}",
            code="unsupported_media_type",
        )
