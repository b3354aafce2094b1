"""The API's reading of images a request names by file or web address: only where its settings allow, bounded in
size and time, each failure a 400 naming the request's field. (Data URLs and each dialect's shapes are tested end
to end in test_vision.py.)"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from helpers.tiny_vlm import png
from jetshard_api.errors import ApiError
from jetshard_api.images import ImageSettings, load_image_urls
from jetshard_schema.types import MAX_IMAGE_BYTES, MAX_IMAGES

PICTURE = png(8, 8, seed=3)
FIELD = "messages[0].content[0].image_url"


class _Pictures(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/slow.png":
            time.sleep(2)
        body = {"/big.png": PICTURE + b"\0" * MAX_IMAGE_BYTES, "/text": b"hello"}.get(self.path, PICTURE)
        self.send_response(404 if self.path == "/missing.png" else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the API stops reading past its limit
            self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def web() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Pictures)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


async def refused(url: str, settings: ImageSettings) -> str:
    with pytest.raises(ApiError) as caught:
        await load_image_urls([(url, FIELD)], settings)
    assert (caught.value.status, caught.value.param) == (400, FIELD)
    return str(caught.value.message)


async def test_web_addresses_are_fetched_only_when_allowed_and_within_bounds(web: str) -> None:
    allowed = ImageSettings(fetch_urls=True, fetch_timeout_s=0.5)
    assert await load_image_urls([(f"{web}/a.png", FIELD)], allowed) == {f"{web}/a.png": PICTURE}
    assert "fetches no image URLs" in await refused(f"{web}/a.png", ImageSettings())
    assert "HTTP 404" in await refused(f"{web}/missing.png", allowed)
    assert "took over 0.5 s" in await refused(f"{web}/slow.png", allowed)
    assert f"images may take {MAX_IMAGE_BYTES} bytes" in await refused(f"{web}/big.png", allowed)
    assert "not a PNG, JPEG, GIF or WebP" in await refused(f"{web}/text", allowed)
    # More addresses than a request may carry images are refused before any is fetched.
    many = [(f"{web}/a.png?{i}", FIELD) for i in range(MAX_IMAGES + 1)]
    with pytest.raises(ApiError, match=f"up to {MAX_IMAGES} images"):
        await load_image_urls(many, allowed)


async def test_local_files_are_read_only_inside_the_allowed_directories(tmp_path: Path) -> None:
    pictures, elsewhere = tmp_path / "pictures", tmp_path / "elsewhere"
    pictures.mkdir()
    elsewhere.mkdir()
    (pictures / "a.png").write_bytes(PICTURE)
    (elsewhere / "b.png").write_bytes(PICTURE)
    (pictures / "escape.png").symlink_to(elsewhere / "b.png")
    settings = ImageSettings(local_dirs=(str(pictures),))

    url = (pictures / "a.png").as_uri()
    assert await load_image_urls([(url, FIELD)], settings) == {url: PICTURE}
    assert "reads no local image files" in await refused(url, ImageSettings())
    for outside in (elsewhere / "b.png", pictures / "escape.png", pictures / ".." / "elsewhere" / "b.png"):
        assert "outside the API's image directories" in await refused(outside.as_uri(), settings)
    assert "cannot be read" in await refused((pictures / "gone.png").as_uri(), settings)
    assert "another host" in await refused("file://example.com/a.png", settings)
