"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`; a dialect with a shape of its
own answers with the same handlers, reshaped (`error_handlers_answering`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgspec
from jetshard_schema.types import RejectCode
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi.datastructures import ResponseSpec
from litestar.types import ExceptionHandlersMap

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}

REJECT_STATUS = {
    RejectCode.INVALID: 400,
    RejectCode.NOT_FOUND: 404,
    RejectCode.CONFLICT: 409,
    RejectCode.ALREADY_EXISTS: 409,
    RejectCode.INSUFFICIENT_MEMORY: 409,
    RejectCode.NOT_ENOUGH_NODES: 409,
    RejectCode.NO_CAPACITY: 503,
    RejectCode.MODEL_UNAVAILABLE: 503,
    RejectCode.QUEUE_FULL: 429,
    RejectCode.FORBIDDEN: 403,
}


class ErrorDetail(msgspec.Struct, frozen=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(msgspec.Struct, frozen=True):
    error: ErrorDetail


def _documented(descriptions: dict[int, str]) -> dict[int, ResponseSpec]:
    return {
        status: ResponseSpec(data_container=ErrorBody, description=description)
        for status, description in descriptions.items()
    }


ERROR_RESPONSES = _documented(
    {
        400: "invalid request",
        401: "missing or wrong API key",
        403: "refused: a foreign Origin",
        404: "not found",
        409: "conflicts with the cluster's state",
        413: "request body too large",
        415: "not a JSON body",
        503: "no capacity, or the model cannot be served",
        504: "the cluster did not answer in time",
    }
)
"""Documented on every route, in the shape every error takes (Litestar would document its own)."""
INFERENCE_RESPONSES = {
    **ERROR_RESPONSES,
    **_documented({429: "the model's queue is full; try again after the `Retry-After` header's seconds"}),
}
"""The routes that submit a task: those may also find its instances' queues full."""


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers


@contextlib.contextmanager
def refused_as_bad_request(code: str, param: str | None = None) -> Iterator[None]:
    """A ValueError raised inside (a check's own message) becomes the request's 400, with `code` and naming
    `param`, the request field the checked value came from."""
    try:
        yield
    except ValueError as error:
        raise ApiError(400, str(error), code, param) from error


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict[str, object]:
    return {"error": {"message": message, "type": _TYPES.get(status, "api_error"), "param": param, "code": code}}


def api_error_handler(_: Request, error: ApiError) -> Response[dict[str, object]]:
    return Response(
        error_body(error.status, error.message, error.code, error.param),
        status_code=error.status,
        headers=error.headers,
    )


def routed(request: Request[Any, Any, Any]) -> bool:
    """Whether a route took the request: an error before that found no route for its path or method."""
    return "route_handler" in request.scope


def http_error_handler(request: Request, error: HTTPException) -> Response[dict[str, object]]:
    message = error.detail
    if isinstance(error, ValidationException) and error.extra:
        message = f"{error.detail}: {_problems(error.extra)}"
    elif not routed(request) and error.status_code == 404:
        message = f"{request.method} {request.url.path} is not an endpoint of this API (they are listed at /openapi)"
    elif not routed(request) and error.status_code == 405:
        message = f"{request.url.path} does not take {request.method} (its methods are listed at /openapi)"
    code = "request_too_large" if error.status_code == 413 else None
    return Response(error_body(error.status_code, str(message), code), status_code=error.status_code)


def _problems(extra: object) -> str:
    """Litestar's list of what failed, in words: an absent body is named as such (Litestar says `'data'`)."""
    if not isinstance(extra, list) or not all(isinstance(problem, dict) for problem in extra):
        return str(extra)
    return "; ".join(
        "the request has no JSON body"
        if problem.get("source") == "body" and problem.get("key") == "data"
        else f"{problem.get('key')} ({problem.get('source')}): {problem.get('message')}"
        for problem in extra
    )


def nesting_error_handler(_: Request, error: RecursionError) -> Response[dict[str, object]]:
    # msgspec gives up on a deeply nested body with a RecursionError: the request is at fault, not the server.
    return Response(error_body(400, f"the JSON body is nested too deeply: {error}"), status_code=400)


def internal_error_handler(request: Request, error: Exception) -> Response[dict[str, object]]:
    log.error("%s %s failed", request.method, request.url.path, exc_info=error)
    return Response(error_body(500, f"internal error: {error}"), status_code=500)


ERROR_HANDLERS: ExceptionHandlersMap = {
    ApiError: api_error_handler,
    HTTPException: http_error_handler,
    RecursionError: nesting_error_handler,
    Exception: internal_error_handler,
}
"""The app's: every error, in the OpenAI shape."""


def error_handlers_answering(body: Callable[[int, str], msgspec.Struct]) -> ExceptionHandlersMap:
    """The app's error handlers, answering `body(status, message)` instead of the OpenAI shape, with the same
    status and headers: a dialect's controller declares them for its own error shape."""

    def reshaped(handler: Callable[[Request[Any, Any, Any], Any], Response[Any]]) -> Callable[..., Response[Any]]:
        def handle(request: Request[Any, Any, Any], error: Exception) -> Response[msgspec.Struct]:
            response = handler(request, error)
            reshaped_body = body(response.status_code or 500, response.content["error"]["message"])
            return Response(reshaped_body, status_code=response.status_code, headers=response.headers)

        return handle

    return {kind: reshaped(handler) for kind, handler in ERROR_HANDLERS.items()}


def error_handlers_by_path(dialects: Mapping[str, ExceptionHandlersMap]) -> ExceptionHandlersMap:
    """The app's error handlers, each answering as the dialect whose path prefix (`dialects`, with its controller's
    handlers) the request is under, else in the OpenAI shape: an error raised before a controller took the
    request (no route for its path or method) still comes in the shape its client reads."""

    def dispatching(kind: int | type[Exception], handler: Callable[..., Response[Any]]) -> Callable[..., Response[Any]]:
        def handle(request: Request[Any, Any, Any], error: Exception) -> Response[Any]:
            path = request.url.path
            for prefix, handlers in dialects.items():
                if path == prefix or path.startswith(f"{prefix}/"):
                    return handlers[kind](request, error)
            return handler(request, error)

        return handle

    return {kind: dispatching(kind, handler) for kind, handler in ERROR_HANDLERS.items()}


def inference_responses_in(body_type: type[msgspec.Struct]) -> dict[int, ResponseSpec]:
    """`INFERENCE_RESPONSES`, documented with a dialect's own error body."""
    return {
        status: ResponseSpec(data_container=body_type, description=spec.description)
        for status, spec in INFERENCE_RESPONSES.items()
    }


def answering(body_type: type[msgspec.Struct], responses: dict[int, ResponseSpec]) -> dict[int, ResponseSpec]:
    """`responses` with `body_type`, the route's answer when it does not stream, as its 200: a route that may also
    stream returns a union of the two, which Litestar documents as an empty schema."""
    answer = ResponseSpec(data_container=body_type, description="the answer; with `stream`, its events instead")
    return {200: answer, **responses}
