"""PyScreeze's screenshot and image-locating functions, for the sandbox's pyautogui shim.

Runs inside the jail with the system python3: the standard library plus Debian's ``python3-xlib``
(no Pillow, no OpenCV). Behaves as PyScreeze 0.1.30 does without OpenCV (the version PyAutoGUI
0.9.54, OSWorld's, uses): ``locate*`` search for an exact pixel match (RGB, or luma with
``grayscale=True``), the needle's alpha channel is dropped as ``Image.convert('RGB')`` drops it,
and a search that finds nothing raises ``ImageNotFoundException`` (``USE_IMAGE_NOT_FOUND_EXCEPTION``
is True, as in 0.1.30). ``confidence=`` needs OpenCV in PyScreeze and raises
``NotImplementedError`` here as there. Needles and haystacks are PNG file paths or ``Image``
objects of this module (``screenshot()`` returns one; there is no Pillow to return PIL images).
"""

from __future__ import annotations

import collections
import struct
import time
import zlib

__all__ = [
    "Box",
    "Image",
    "ImageNotFoundException",
    "Point",
    "PyScreezeException",
    "RGB",
    "center",
    "locate",
    "locateAll",
    "locateAllOnScreen",
    "locateCenterOnScreen",
    "locateOnScreen",
    "locateOnWindow",
    "pixel",
    "pixelMatchesColor",
    "screenshot",
]

USE_IMAGE_NOT_FOUND_EXCEPTION = True
GRAYSCALE_DEFAULT = False

Box = collections.namedtuple("Box", "left top width height")
Point = collections.namedtuple("Point", "x y")
RGB = collections.namedtuple("RGB", "red green blue")


class PyScreezeException(Exception):
    """A PyScreeze-related error."""


class ImageNotFoundException(PyScreezeException):
    """The locate functions found no match."""


class Image:
    """A minimal RGB image (what PyScreeze's functions return or take instead of a PIL image).

    Attributes:
      width, height: size in pixels.
      data: packed 8-bit RGB, row-major.
    """

    mode = "RGB"

    def __init__(self, width: int, height: int, data: bytes) -> None:
        if len(data) != width * height * 3:
            raise ValueError(f"RGB data of {len(data)} bytes for a {width}x{height} image")
        self.width, self.height, self.data = width, height, bytes(data)

    @property
    def size(self) -> tuple[int, int]:
        """(width, height)."""
        return self.width, self.height

    def getpixel(self, xy) -> tuple[int, int, int]:
        """The (r, g, b) at (x, y)."""
        x, y = int(xy[0]), int(xy[1])
        if not (0 <= x < self.width and 0 <= y < self.height):
            raise IndexError("image index out of range")
        i = (y * self.width + x) * 3
        return self.data[i], self.data[i + 1], self.data[i + 2]

    def crop(self, box) -> Image:
        """The sub-image (left, upper, right, lower)."""
        left, top, right, bottom = (int(v) for v in box)
        left, top = max(0, left), max(0, top)
        right, bottom = min(self.width, right), min(self.height, bottom)
        w, h = max(0, right - left), max(0, bottom - top)
        rows = [self.data[((top + y) * self.width + left) * 3 :][: w * 3] for y in range(h)]
        return Image(w, h, b"".join(rows))

    def save(self, fp) -> None:
        """Writes the image as PNG to a path or binary file."""
        png = encode_png(self.width, self.height, self.data)
        if hasattr(fp, "write"):
            fp.write(png)
        else:
            with open(fp, "wb") as f:
                f.write(png)


# ----------------------------------------------------------------------------------------------
# PNG (stdlib zlib): enough of the format for screenshots and the needles agents save.


def encode_png(width: int, height: int, rgb: bytes) -> bytes:
    """8-bit RGB, no interlace, filter 0."""
    stride = width * 3
    raw = b"".join(b"\x00" + rgb[y * stride : (y + 1) * stride] for y in range(height))

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + body))
        return struct.pack(">I", len(body)) + kind + body + crc

    head = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", head)
        + chunk(b"IDAT", zlib.compress(raw, 1))
        + chunk(b"IEND", b"")
    )


def _unfilter(raw: bytes, height: int, stride: int, bpp: int) -> bytearray:
    out = bytearray(height * stride)
    prev = bytearray(stride)
    pos = 0
    for y in range(height):
        ftype = raw[pos]
        line = bytearray(raw[pos + 1 : pos + 1 + stride])
        pos += 1 + stride
        if ftype == 1:
            for i in range(bpp, stride):
                line[i] = (line[i] + line[i - bpp]) & 0xFF
        elif ftype == 2:
            for i in range(stride):
                line[i] = (line[i] + prev[i]) & 0xFF
        elif ftype == 3:
            for i in range(stride):
                left = line[i - bpp] if i >= bpp else 0
                line[i] = (line[i] + ((left + prev[i]) >> 1)) & 0xFF
        elif ftype == 4:
            for i in range(stride):
                a = line[i - bpp] if i >= bpp else 0
                b = prev[i]
                c = prev[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[i] = (line[i] + pred) & 0xFF
        elif ftype != 0:
            raise PyScreezeException(f"PNG: bad filter type {ftype}")
        out[y * stride : (y + 1) * stride] = line
        prev = line
    return out


def decode_png(data: bytes) -> Image:
    """Decodes a non-interlaced 8-bit PNG (gray, RGB, palette, with or without alpha) to RGB."""
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        raise PyScreezeException("only PNG images can be read in the sandbox (no Pillow)")
    pos, idat, palette = 8, [], b""
    width = height = depth = ctype = interlace = 0
    while pos + 8 <= len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
        elif kind == b"PLTE":
            palette = body
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    if depth != 8 or interlace or ctype not in (0, 2, 3, 4, 6):
        raise PyScreezeException(
            f"PNG: unsupported format (bit depth {depth}, color type {ctype}, interlace "
            f"{interlace}); save the needle as an 8-bit non-interlaced PNG"
        )
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[ctype]
    pix = _unfilter(zlib.decompress(b"".join(idat)), height, width * channels, channels)
    rgb: bytes | bytearray
    if ctype == 2:
        rgb = pix
    elif ctype == 6:
        rgb = bytearray(width * height * 3)
        for k in range(3):
            rgb[k::3] = pix[k::4]
    elif ctype in (0, 4):
        gray = pix[0::channels]
        rgb = bytearray(width * height * 3)
        for k in range(3):
            rgb[k::3] = gray
    else:
        rgb = b"".join(palette[3 * i : 3 * i + 3] for i in pix)
    return Image(width, height, bytes(rgb))


def _load(img) -> Image:
    if isinstance(img, Image):
        return img
    if isinstance(img, (str, bytes)) or hasattr(img, "__fspath__"):
        with open(img, "rb") as f:
            return decode_png(f.read())
    raise TypeError("expected a PNG filename or a pyscreeze.Image (the sandbox has no Pillow)")


def _luma(img: Image) -> Image:
    """ITU-R 601-2 luma, as PIL's ``convert('L')``, replicated into three channels."""
    d = img.data
    lum = bytes(
        (r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16
        for r, g, b in zip(d[0::3], d[1::3], d[2::3], strict=True)
    )
    out = bytearray(len(d))
    for k in range(3):
        out[k::3] = lum
    return Image(img.width, img.height, bytes(out))


# ----------------------------------------------------------------------------------------------
# Locating.


def locateAll(  # noqa: N802 - PyScreeze name
    needleImage,  # noqa: N803
    haystackImage,  # noqa: N803
    grayscale=None,
    limit=None,
    region=None,
    step=1,
    confidence=None,
):
    """Yields a ``Box`` for each exact occurrence of the needle in the haystack, row by row.

    Raises ``ImageNotFoundException`` (when iterated to the end) if there is none.
    """
    if confidence is not None:
        raise NotImplementedError(
            "The confidence keyword argument is only available if OpenCV is installed."
        )
    if grayscale is None:
        grayscale = GRAYSCALE_DEFAULT
    needle, hay = _load(needleImage), _load(haystackImage)
    if region is not None:
        hay = hay.crop((region[0], region[1], region[0] + region[2], region[1] + region[3]))
        ox, oy = int(region[0]), int(region[1])
    else:
        ox = oy = 0
    if grayscale:
        needle, hay = _luma(needle), _luma(hay)
    nw, nh, hw, hh = needle.width, needle.height, hay.width, hay.height
    found = 0
    if 0 < nw <= hw and 0 < nh <= hh:
        nrows = [needle.data[y * nw * 3 : (y + 1) * nw * 3] for y in range(nh)]
        hrow = lambda y: hay.data[y * hw * 3 : (y + 1) * hw * 3]  # noqa: E731
        for y in range(hh - nh + 1):
            row, start = hrow(y), 0
            while True:
                i = row.find(nrows[0], start)
                if i < 0 or i // 3 > hw - nw:
                    break
                start = i + 1
                if i % 3:
                    continue
                x = i // 3
                if all(
                    hay.data[((y + k) * hw + x) * 3 :][: nw * 3] == nrows[k] for k in range(1, nh)
                ):
                    found += 1
                    yield Box(x + ox, y + oy, nw, nh)
                    if limit is not None and found >= limit:
                        return
    if found == 0 and USE_IMAGE_NOT_FOUND_EXCEPTION:
        raise ImageNotFoundException("Could not locate the image.")


def locate(needleImage, haystackImage, **kwargs):  # noqa: N802,N803
    """The first match (``Box``); raises ``ImageNotFoundException`` when there is none."""
    kwargs["limit"] = 1
    try:
        points = tuple(locateAll(needleImage, haystackImage, **kwargs))
    except ImageNotFoundException:
        points = ()
    if points:
        return points[0]
    if USE_IMAGE_NOT_FOUND_EXCEPTION:
        raise ImageNotFoundException("Could not locate the image.")
    return None


def locateOnScreen(image, minSearchTime=0, **kwargs):  # noqa: N802,N803
    """``locate`` on fresh screenshots until found or ``minSearchTime`` seconds have passed."""
    start = time.time()
    while True:
        try:
            found = locate(image, screenshot(), **kwargs)
        except ImageNotFoundException:
            if time.time() - start > minSearchTime:
                raise
            continue
        if found or time.time() - start > minSearchTime:
            return found


def locateAllOnScreen(image, **kwargs):  # noqa: N802
    """``locateAll`` on one screenshot."""
    return locateAll(image, screenshot(), **kwargs)


def locateCenterOnScreen(image, **kwargs):  # noqa: N802
    """The center ``Point`` of ``locateOnScreen``."""
    coords = locateOnScreen(image, **kwargs)
    return None if coords is None else center(coords)


def locateOnWindow(image, title, **kwargs):  # noqa: N802
    """Needs PyGetWindow (Windows only), as in PyScreeze on Linux."""
    raise PyScreezeException(
        "locateOnWindow() failed because PyGetWindow is not installed or is unsupported on this "
        "platform."
    )


def center(coords) -> Point:
    """The center of a (left, top, width, height) box."""
    return Point(coords[0] + int(coords[2] / 2), coords[1] + int(coords[3] / 2))


# ----------------------------------------------------------------------------------------------
# The screen (X11 GetImage through python3-xlib).


def screenshot(imageFilename=None, region=None) -> Image:  # noqa: N803
    """The screen (optionally a (left, top, width, height) region) as an ``Image``."""
    from Xlib import X, display

    d = display.Display()
    try:
        root = d.screen().root
        geom = root.get_geometry()
        img = root.get_image(0, 0, geom.width, geom.height, X.ZPixmap, 0xFFFFFFFF)
        raw = img.data if isinstance(img.data, bytes) else bytes(img.data)
    finally:
        d.close()
    n = geom.width * geom.height
    if len(raw) != n * 4:
        raise PyScreezeException(
            f"unexpected X image size {len(raw)} for {geom.width}x{geom.height}"
        )
    rgb = bytearray(n * 3)
    rgb[0::3], rgb[1::3], rgb[2::3] = raw[2::4], raw[1::4], raw[0::4]
    im = Image(geom.width, geom.height, bytes(rgb))
    if region is not None:
        im = im.crop((region[0], region[1], region[0] + region[2], region[1] + region[3]))
    if imageFilename is not None:
        im.save(imageFilename)
    return im


def pixel(x, y) -> RGB:
    """The color of the screen at (x, y)."""
    return RGB(*screenshot(region=(int(x), int(y), 1, 1)).getpixel((0, 0)))


def pixelMatchesColor(x, y, expectedRGBColor, tolerance=0) -> bool:  # noqa: N802,N803
    """Whether the screen's color at (x, y) is within ``tolerance`` of the expected one."""
    got = pixel(x, y)
    want = tuple(expectedRGBColor)[:3]
    return all(abs(a - b) <= tolerance for a, b in zip(got, want, strict=True))
