"""Images in requests, for vision models: each dialect's way of carrying one (an OpenAI `image_url` part's data
URL, local file or web address; Anthropic's base64 `image` block; Ollama's base64 `images`), checked to be an
image file of a known format and kept within `MAX_IMAGES` and `MAX_IMAGE_BYTES` per request. The runner decodes
them with the model's processor; a file that only looks like an image is refused there, also with a 400.

Reading a local file or fetching a web address is the API's own I/O on a client's behalf, so each is off unless
the API is told where it may read (`ImageSettings`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import os
import re
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import unquote, urlparse

import httpx
from jetshard_schema.types import MAX_IMAGE_BYTES, MAX_IMAGES, ChatMessage, TaskRequest

from jetshard_api.errors import ApiError
from jetshard_api.settings import ImageSettings

_DATA_URL = re.compile(r"^data:(?P<type>[\w.+-]+/[\w.+-]+)?(?:;[^,;]*)*;base64,(?P<data>.*)$", re.DOTALL)
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
)


def image_file(data: bytes, param: str) -> bytes:
    """`data` if it is a PNG, JPEG, GIF or WebP file of at most `MAX_IMAGE_BYTES`; else a 400 naming `param`."""
    if len(data) > MAX_IMAGE_BYTES:
        raise _invalid(param, f"{param} is {len(data)} bytes; images may take {MAX_IMAGE_BYTES} bytes per request")
    if not any(data.startswith(signature) for signature, _ in _SIGNATURES) and not _is_webp(data):
        raise _invalid(param, f"{param} is not a PNG, JPEG, GIF or WebP image")
    return data


def base64_image(text: str, param: str) -> bytes:
    """A base64 image (Anthropic's and Ollama's form), checked."""
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as error:
        raise _invalid(param, f"{param} is not valid base64: {error}") from error
    return image_file(data, param)


def is_data_url(url: str) -> bool:
    return url.startswith("data:")


def data_url_image(url: str, param: str) -> bytes:
    """The image a `data:image/...;base64,` URL carries, checked."""
    match = _DATA_URL.match(url)
    if match is None or not (match.group("type") or "image/").startswith("image/"):
        raise _invalid(param, f"{param} must be a base64 data URL of an image (data:image/png;base64,...)")
    return base64_image(match.group("data"), param)


async def load_image_urls(urls: Iterable[tuple[str, str]], settings: ImageSettings) -> dict[str, bytes]:
    """The images that (url, param) pairs name by a `file://` or `http(s)://` URL, read where `settings` allow;
    a 400 naming the param for a URL that is not allowed, not found, too large or not an image."""
    urls = list(urls)
    if len({url for url, _ in urls}) > MAX_IMAGES:  # refused before anything is read or fetched
        raise _invalid(urls[0][1], f"a request may carry up to {MAX_IMAGES} images, this one names {len(urls)}")
    loaded: dict[str, bytes] = {}
    total = 0
    async with contextlib.AsyncExitStack() as stack:
        client: httpx.AsyncClient | None = None
        for url, param in urls:
            if url in loaded:
                continue
            scheme = urlparse(url).scheme
            if scheme == "file":
                data = await asyncio.to_thread(_read_local, url, param, settings)
            elif scheme in ("http", "https"):
                if not settings.fetch_urls:
                    raise _invalid(
                        param, f"{param} is a web address, and this API fetches no image URLs: send a data URL"
                    )
                if client is None:  # made once a request needs it: a TLS context takes a while to build
                    client = await stack.enter_async_context(httpx.AsyncClient())
                data = await _fetch(client, url, param, settings.fetch_timeout_s)
            else:
                raise _invalid(param, f"{param} must be a data:, file:// or http(s):// URL of an image")
            loaded[url] = image_file(data, param)
            total += len(data)
            if total > MAX_IMAGE_BYTES:
                raise _invalid(param, f"the request's images take more than {MAX_IMAGE_BYTES} bytes")
    return loaded


def check_images(messages: Iterable[ChatMessage], param: str = "messages") -> None:
    """The request's images together stay within `MAX_IMAGES` and `MAX_IMAGE_BYTES`."""
    images = [image for message in messages for image in message.images]
    if len(images) > MAX_IMAGES:
        raise _invalid(param, f"a request may carry up to {MAX_IMAGES} images, this one has {len(images)}")
    if sum(len(image) for image in images) > MAX_IMAGE_BYTES:
        raise _invalid(param, f"the request's images take more than {MAX_IMAGE_BYTES} bytes")


def has_images(task: TaskRequest) -> bool:
    return any(message.images for message in task.messages)


def _is_webp(data: bytes) -> bool:
    return data[:4] == b"RIFF" and data[8:12] == b"WEBP"


def _read_local(url: str, param: str, settings: ImageSettings) -> bytes:
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise _invalid(param, f"{param} names a file on another host ({parsed.netloc})")
    path = Path(os.path.realpath(unquote(parsed.path)))
    allowed = [Path(os.path.realpath(d)) for d in settings.local_dirs]
    if not any(path.is_relative_to(d) for d in allowed):
        why = "the API reads no local image files" if not allowed else "it is outside the API's image directories"
        raise _invalid(param, f"{param} names a local file, and {why}")
    try:
        with path.open("rb") as file:
            return file.read(MAX_IMAGE_BYTES + 1)
    except OSError as error:
        raise _invalid(param, f"{param}: the file cannot be read ({error.strerror})") from error


async def _fetch(client: httpx.AsyncClient, url: str, param: str, timeout_s: float) -> bytes:
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("GET", url, follow_redirects=True) as response:
                if response.status_code != 200:
                    raise _invalid(param, f"{param}: fetching the image answered HTTP {response.status_code}")
                data = bytearray()
                async for piece in response.aiter_bytes():
                    data += piece
                    if len(data) > MAX_IMAGE_BYTES:
                        break
                return bytes(data)
    except TimeoutError as error:
        raise _invalid(param, f"{param}: fetching the image took over {timeout_s:g} s") from error
    except httpx.HTTPError as error:
        raise _invalid(param, f"{param}: the image could not be fetched ({error})") from error


def _invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, "invalid_image", param)
