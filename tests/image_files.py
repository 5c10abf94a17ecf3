"""Real image files made with pillow at test time, and data URIs of them."""

import base64
import io

from PIL import Image


def image_bytes(fmt: str = "PNG", size: tuple[int, int] = (32, 32), seed: int = 0) -> bytes:
    """A `size` image of a colour pattern (different per `seed`), encoded as `fmt`."""
    image = Image.new("RGB", size)
    image.putdata(
        [
            ((x * 7 + seed * 50) % 256, (y * 11 + seed * 30) % 256, (x * y + seed) % 256)
            for y in range(size[1])
            for x in range(size[0])
        ]
    )
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"
