"""Image input: the image parts of a request's messages, checked and moved into the job.

Both dialects arrive here as OpenAI `image_url` parts (an Anthropic `image` block becomes one:
gateway/dialects/protocol/anthropic.py). `take_images` replaces each with a bare `{"type": "image"}`
placeholder and appends the image's encoded bytes to `GenerationRequest.images`, in order, so the
node's processor sees the image where the message put it. Every image is opened with pillow here
(PNG, JPEG, WebP, GIF's first frame), within size and pixel limits, so a broken one is a 400 that
names its part and never reaches a node. `data:` URIs are decoded in memory; an `http(s)` URL is
refused unless its host is in `image_url_hosts`, and only then fetched (size limit, timeout, no
redirects). Nothing else here does I/O.
"""

import asyncio
import base64
import binascii
import io
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from PIL import Image

from shared.errors import InvalidRequest
from shared.settings import GatewaySettings
from shared.wire import GenerationRequest

FORMATS = {"PNG", "JPEG", "WEBP", "GIF"}
_DATA_URI = re.compile(
    r"data:(?P<mime>[^;,]*)(?P<params>(;[^;,]*)*);base64,(?P<data>.*)", re.DOTALL | re.IGNORECASE
)


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int
    max_pixels: int
    max_side: int
    per_request: int
    url_hosts: frozenset[str]
    fetch_timeout_s: float

    @classmethod
    def of(cls, settings: GatewaySettings) -> "ImageLimits":
        return cls(
            settings.image_max_bytes,
            settings.image_max_pixels,
            settings.image_max_side,
            settings.images_per_request,
            frozenset(h.lower() for h in settings.image_url_hosts),
            settings.image_fetch_timeout_s,
        )


def check_image(data: bytes, limits: ImageLimits, where: str) -> None:
    """Refuse (400, naming `where`) bytes that are not one readable PNG/JPEG/WebP/GIF image within
    the limits. The size is checked from the header before any pixel is decoded."""
    if len(data) > limits.max_bytes:
        raise InvalidRequest(
            f"{where}: the image has {len(data)} bytes; at most {limits.max_bytes} are accepted",
            param=where,
        )
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format not in FORMATS:
                raise InvalidRequest(
                    f"{where}: {image.format} images are not accepted; send PNG, JPEG, WebP or GIF",
                    param=where,
                )
            width, height = image.size
            if max(width, height) > limits.max_side or width * height > limits.max_pixels:
                raise InvalidRequest(
                    f"{where}: the image is {width}x{height} pixels; at most {limits.max_side} per "
                    f"side and {limits.max_pixels} in all are accepted",
                    param=where,
                )
            image.load()  # decodes the (first) frame: a truncated or corrupt image fails here
    except InvalidRequest:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidRequest(f"{where}: not a readable image ({exc})", param=where) from None


def decode_data_uri(url: str, limits: ImageLimits, where: str) -> bytes:
    match = _DATA_URI.fullmatch(url)
    if match is None:
        raise InvalidRequest(
            f"{where}: a data URI must be base64 (data:image/png;base64,...)", param=where
        )
    encoded = re.sub(r"\s+", "", match["data"])
    if len(encoded) * 3 // 4 > limits.max_bytes + 2:  # refused before decoding
        raise InvalidRequest(
            f"{where}: the image has about {len(encoded) * 3 // 4} bytes; at most {limits.max_bytes} "
            "are accepted",
            param=where,
        )
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{where}: the data URI is not valid base64", param=where) from None


async def fetch(url: str, limits: ImageLimits, where: str) -> bytes:
    """An allow-listed image URL's bytes, at most `max_bytes`, within the fetch timeout."""
    try:
        async with httpx.AsyncClient(
            timeout=limits.fetch_timeout_s, follow_redirects=False, trust_env=False
        ) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise InvalidRequest(
                        f"{where}: fetching the image gave HTTP {response.status_code}", param=where
                    )
                data = bytearray()
                async for chunk in response.aiter_bytes():
                    data += chunk
                    if len(data) > limits.max_bytes:
                        raise InvalidRequest(
                            f"{where}: the image is over {limits.max_bytes} bytes", param=where
                        )
                return bytes(data)
    except httpx.HTTPError as exc:
        raise InvalidRequest(
            f"{where}: the image could not be fetched ({type(exc).__name__})", param=where
        ) from None


async def image_bytes(url: str, limits: ImageLimits, where: str) -> bytes:
    """The encoded image a part's URL names: a data URI, or an allow-listed http(s) URL."""
    if url[:5].lower() == "data:":
        return decode_data_uri(url, limits, where)
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https"):
        raise InvalidRequest(f"{where}: image URLs must be data: URIs (base64)", param=where)
    if (parts.hostname or "").lower() not in limits.url_hosts:
        raise InvalidRequest(
            f"{where}: image URLs from {parts.hostname or 'that host'} are not fetched; send the image "
            "as a data: URI (base64)",
            param=where,
        )
    return await fetch(url, limits, where)


def _image_parts(request: GenerationRequest) -> list[tuple[str, list, int]]:
    """(where, the content list, the index in it) of every image part, in message order."""
    found = []
    for m, message in enumerate(request.messages or []):
        content = message.get("content")
        if isinstance(content, list):
            found += [
                (f"messages[{m}].content[{p}]", content, p)
                for p, part in enumerate(content)
                if isinstance(part, dict) and part.get("type") in ("image_url", "image")
            ]
    return found


async def take_images(request: GenerationRequest, limits: ImageLimits, *, vision: bool) -> None:
    """Move every image of `request`'s messages into `request.images`, checked; 400 for a model
    that cannot read images, too many images, or an image that is refused."""
    found = _image_parts(request)
    if not found:
        return
    if not vision:
        raise InvalidRequest(
            f"the model {request.model} is text-only and cannot read images ({found[0][0]})",
            param=found[0][0],
        )
    if len(found) > limits.per_request:
        raise InvalidRequest(
            f"the request has {len(found)} images; at most {limits.per_request} are accepted",
            param="messages",
        )
    for where, content, index in found:
        url = ((content[index].get("image_url") or {}).get("url")) or ""
        data = await image_bytes(url, limits, where)
        await asyncio.to_thread(
            check_image, data, limits, where
        )  # decoding pixels: off the event loop
        content[index] = {"type": "image"}
        request.images.append(data)
