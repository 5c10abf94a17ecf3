"""gateway/jobs/images.py: image parts checked with pillow and moved into the job; limits; URLs."""

import asyncio

import pytest

from gateway.jobs.images import ImageLimits, check_image, take_images
from shared.errors import InvalidRequest
from shared.settings import GatewaySettings
from shared.wire import GenerationRequest
from tests.image_files import data_uri, image_bytes

LIMITS = ImageLimits.of(
    GatewaySettings(image_max_bytes=64 * 1024, image_max_pixels=200 * 200, image_max_side=300)
)


def chat(*parts: dict) -> GenerationRequest:
    return GenerationRequest(
        job="j",
        model="m",
        kind="chat",
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": list(parts)},
        ],
    )


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
async def test_each_format_travels_as_its_bytes_behind_a_placeholder(fmt):
    data = image_bytes(fmt)
    request = chat(
        {"type": "text", "text": "what is it?"}, image_part(data_uri(data, f"image/{fmt.lower()}"))
    )
    await take_images(request, LIMITS, vision=True)
    assert request.images == [data]
    assert request.messages[1]["content"] == [
        {"type": "text", "text": "what is it?"},
        {"type": "image"},
    ]


async def test_images_keep_their_order_across_messages():
    first, second = image_bytes(seed=1), image_bytes("JPEG", seed=2)
    request = chat(image_part(data_uri(first)))
    request.messages.append(
        {"role": "user", "content": [image_part(data_uri(second, "image/jpeg"))]}
    )
    await take_images(request, LIMITS, vision=True)
    assert request.images == [first, second]


@pytest.mark.parametrize(
    "url, says",
    [
        (data_uri(image_bytes()[:60]), "not a readable image"),  # truncated PNG
        (data_uri(b"definitely not an image"), "not a readable image"),
        (data_uri(image_bytes("BMP"), "image/bmp"), "BMP images are not accepted"),
        ("data:image/png;base64,@@@@", "not valid base64"),
        ("data:image/png,rawbytes", "must be base64"),
        (data_uri(image_bytes(size=(301, 10))), "301x10 pixels"),
        (data_uri(image_bytes(size=(250, 250))), "250x250 pixels"),
        (data_uri(b"\0" * (70 * 1024)), "at most 65536"),
        ("file:///etc/passwd", "must be data: URIs"),
        ("http://127.0.0.1:9/cat.png", "are not fetched"),
    ],
)
async def test_a_bad_image_is_a_400_naming_its_part(url, says):
    request = chat({"type": "text", "text": "look"}, image_part(url))
    with pytest.raises(InvalidRequest, match=says) as caught:
        await take_images(request, LIMITS, vision=True)
    assert caught.value.param == "messages[1].content[1]"
    assert caught.value.status == 400


async def test_a_text_only_model_refuses_images():
    request = chat(image_part(data_uri(image_bytes())))
    with pytest.raises(InvalidRequest, match="text-only"):
        await take_images(request, LIMITS, vision=False)


async def test_too_many_images():
    limits = ImageLimits.of(GatewaySettings(images_per_request=2))
    request = chat(*[image_part(data_uri(image_bytes())) for _ in range(3)])
    with pytest.raises(InvalidRequest, match="3 images; at most 2"):
        await take_images(request, limits, vision=True)


def test_a_decompression_bomb_is_refused_from_its_header():
    with pytest.raises(InvalidRequest, match="pixels"):
        check_image(
            image_bytes("PNG", size=(4000, 4000)),
            ImageLimits.of(GatewaySettings(image_max_pixels=1_000_000)),
            "messages[0].content[0]",
        )


class Listener:
    """A loopback TCP server that records every connection and answers one fixed HTTP response."""

    def __init__(self, body: bytes = b"", status: int = 200):
        self.connections, self.body, self.status = 0, body, status

    async def __aenter__(self) -> "Listener":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 %d X\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
            % (self.status, len(self.body))
            + self.body
        )
        await writer.drain()
        writer.close()


async def test_http_urls_make_no_connection_unless_the_host_is_allowed():
    async with Listener(image_bytes()) as listener:
        for url in (
            f"http://127.0.0.1:{listener.port}/cat.png",
            f"https://localhost:{listener.port}/cat.png",
        ):
            with pytest.raises(InvalidRequest, match="are not fetched"):
                await take_images(chat(image_part(url)), LIMITS, vision=True)
        assert listener.connections == 0


async def test_an_allow_listed_host_is_fetched_within_the_limits():
    data = image_bytes()
    limits = ImageLimits.of(
        GatewaySettings(image_url_hosts=["127.0.0.1"], image_max_bytes=len(data))
    )
    async with Listener(data) as listener:
        request = chat(image_part(f"http://127.0.0.1:{listener.port}/cat.png"))
        await take_images(request, limits, vision=True)
        assert request.images == [data] and listener.connections == 1
    async with Listener(data + b"\0") as listener:
        with pytest.raises(InvalidRequest, match="over"):
            await take_images(
                chat(image_part(f"http://127.0.0.1:{listener.port}/big.png")), limits, vision=True
            )
    async with Listener(status=404) as listener:
        with pytest.raises(InvalidRequest, match="HTTP 404"):
            await take_images(
                chat(image_part(f"http://127.0.0.1:{listener.port}/gone.png")), limits, vision=True
            )
