"""The dialects' request bodies (and those of the placement and download routes), decoded once and strictly, with
JSON's own types.

Litestar converts a body leniently (`"max_tokens": "5"` becomes 5); OpenAI refuses a value of the wrong type,
and a client that sends one has a bug to see. A dialect's controller (and a placement or download one) is a
`StrictController`, which declares `dto=StrictBody` (and `return_dto=None`: its answers are encoded as they
are): Litestar then hands the raw body to `decode_bytes`, which decodes it into the type of the handler's
`data`, and documents that type as the request body. A body that does not decode is an ApiError, which the
controller's exception handlers answer in the dialect's shape.
"""

from __future__ import annotations

import re
from collections.abc import Generator
from typing import Any, TypeVar

import msgspec
import msgspec.inspect
from litestar import Controller
from litestar.dto import AbstractDTO, DTOFieldDefinition
from litestar.openapi.spec import Reference, Schema
from litestar.typing import FieldDefinition

from jetshard_api.errors import ApiError

Body = TypeVar("Body")
_ERROR_PATH = re.compile(r"at `\$\.([A-Za-z_]+)")


def strictly_decoded(body: bytes, body_type: type[Body]) -> Body:
    """`body` as `body_type`, or a 400 naming the top-level field at fault."""
    try:
        return msgspec.json.decode(body, type=body_type)
    except msgspec.ValidationError as error:
        wrong_type = error
    except msgspec.DecodeError as error:
        raise _not_json(error) from error
    # The typed decoder stops at the first wrong value. A body that is also malformed, or nested too deeply
    # (RecursionError, which the app answers as the client's fault), is refused for that: it has no field to fix.
    try:
        msgspec.json.decode(body)
    except msgspec.DecodeError as error:
        raise _not_json(error) from error
    field = _ERROR_PATH.search(str(wrong_type))
    name = field.group(1) if field else None
    message = str(wrong_type)
    allowed = _enum_values(body_type, name) if name and message.startswith("Invalid enum value") else []
    if allowed:
        quoted = ", ".join(f'"{value}"' for value in allowed)
        message += f"; {name} is one of: {quoted}"
    raise ApiError(400, message, "invalid_type", name) from wrong_type


def _enum_values(body_type: type[Any], name: str) -> list[str]:
    """The values of the enum that the top-level field `name` of `body_type` takes, if it takes one."""
    info = msgspec.inspect.type_info(body_type)
    if not isinstance(info, msgspec.inspect.StructType):
        return []
    for field in info.fields:
        if field.encode_name == name:
            kinds = field.type.types if isinstance(field.type, msgspec.inspect.UnionType) else (field.type,)
            return [str(m.value) for t in kinds if isinstance(t, msgspec.inspect.EnumType) for m in t.cls]
    return []


def _not_json(error: msgspec.DecodeError) -> ApiError:
    return ApiError(400, f"the body is not valid JSON: {error}", "invalid_json")


class StrictBody(AbstractDTO[Any]):
    """Decodes a handler's `data` with `strictly_decoded`, into the type the handler declares. It builds no
    transfer model, unlike Litestar's DTOs: the wire types are msgspec Structs already."""

    def decode_bytes(self, value: bytes) -> Any:
        data_field = self.asgi_connection.route_handler.parsed_data_field
        assert data_field is not None, "StrictBody decodes the body of a handler that takes `data`"
        return strictly_decoded(value, data_field.annotation)

    @classmethod
    def create_for_field_definition(
        cls, field_definition: FieldDefinition, handler_id: str, backend_cls: Any = None
    ) -> None:
        """Nothing to prepare: `decode_bytes` decodes into the declared type itself."""

    @classmethod
    def create_openapi_schema(
        cls, field_definition: FieldDefinition, handler_id: str, schema_creator: Any
    ) -> Reference | Schema:
        """The declared type's schema, as Litestar documents a body without a DTO."""
        schema: Reference | Schema = schema_creator.for_field_definition(field_definition)
        return schema

    @classmethod
    def generate_field_definitions(cls, model_type: type[Any]) -> Generator[DTOFieldDefinition, None, None]:
        """None: there is no transfer model to build them for."""
        yield from ()

    @classmethod
    def detect_nested_field(cls, field_definition: FieldDefinition) -> bool:
        return False


class StrictController(Controller):
    """Routes whose bodies `StrictBody` decodes (a value of the wrong type is refused, not converted: "4" is not 4),
    and whose answers are encoded as the handlers return them."""

    dto = StrictBody
    return_dto = None
