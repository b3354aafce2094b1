"""The HTTP client of the commands that talk to a running API (`--api URL`, env `JETSHARD_API`), never to NATS,
so they work from any machine that can reach an API.

Errors come back in the OpenAI shape (`{"error": {"message": …}}`) and are raised as one readable line for
stderr (`CliError`), with a non-zero exit status.
"""

from __future__ import annotations

import os
from typing import Any, NoReturn

import click
import httpx

from jetshard.clusterfile import recorded

TIMEOUT_S = 30.0

# Exit statuses: 1 for an error the API reported, 2 is click's usage error, 3 when the API cannot be reached.
EXIT_API_ERROR = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3


def api_headers() -> dict[str, str]:
    """The API key to send: `JETSHARD_API_KEY`, else the one a running `up` recorded; none if neither."""
    key = os.environ.get("JETSHARD_API_KEY") or recorded("api_key")
    return {"Authorization": f"Bearer {key}"} if key else {}


class CliError(click.ClickException):
    """A ClickException with one of the exit statuses above."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]


class ApiClient:
    """A thin HTTP client of the API, turning API errors into `CliError`s."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")

    def request(
        self, method: str, path: str, *, timeout: float = TIMEOUT_S, body: dict[str, Any] | None = None
    ) -> tuple[int, Any]:
        url = self.base_url + path
        try:
            with httpx.Client(timeout=timeout, headers=api_headers()) as client:
                response = client.request(method, url, json=body)
        except httpx.InvalidURL as error:
            _fail(f"{self.base_url} is not a URL an API can be reached at ({error}); set --api", EXIT_USAGE)
        except httpx.TimeoutException:
            _fail(f"the API at {self.base_url} did not answer within {timeout:.0f} s", EXIT_UNREACHABLE)
        except httpx.HTTPError as error:
            _fail(
                f"cannot reach the jetshard API at {self.base_url} ({error}); is `jetshard up` or "
                "`jetshard api` running? (set --api or JETSHARD_API)",
                EXIT_UNREACHABLE,
            )
        try:
            data = response.json()
        except ValueError:
            data = None
        if response.is_error:
            status = response.status_code
            _fail(f"{_error_message(status, data, response.text)} (HTTP {status})")
        return response.status_code, data


def _error_message(status: int, data: Any, text: str) -> str:
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str) and error:
            return error
        if data.get("detail"):
            return str(data["detail"])
    return text.strip()[:500] or f"the API answered HTTP {status}"


def _fail(message: str, code: int = EXIT_API_ERROR) -> NoReturn:
    raise CliError(message, code)
