"""bench/ttft.py on synthetic lines: the figures it reads and a PNG that decodes."""

import io
import os
import struct
import sys
import tempfile
import unittest
import zlib
from contextlib import redirect_stderr, redirect_stdout

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import suitelines  # noqa: E402 (after the path)
import ttft  # noqa: E402


def lines():
    out = ["meta hf-new 64", "result hf decode/pool/llama/32768 tok/s 400 400 1"]
    for arch, k in (("llama", 1.0), ("qwen3", 1.2)):
        for L in (1024, 4096, 8192, 16384, 32768):
            out += suitelines.lines("hf", "ttft/computed/%s/%d" % (arch, L), "ms", [k * L / 100])
            out += suitelines.lines("hf", "ttft/matched/%s/%d" % (arch, L), "ms", [k * (3 + L / 10000)])
    return out


def decode(png):
    """(width, height, rows of RGB bytes) of an 8-bit RGB PNG without filters."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(png):
        n, kind = struct.unpack(">I4s", png[pos:pos + 8])
        data = png[pos + 8:pos + 8 + n]
        crc, = struct.unpack(">I", png[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(kind + data) & 0xFFFFFFFF, kind
        chunks[kind] = data
        pos += 12 + n
    w, h, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, color) == (8, 2)
    raw = zlib.decompress(chunks[b"IDAT"])
    assert len(raw) == h * (1 + 3 * w)
    return w, h, [raw[y * (1 + 3 * w) + 1:(y + 1) * (1 + 3 * w)] for y in range(h)]


class TTFT(unittest.TestCase):
    def test_figures(self):
        f = ttft.figures(lines())
        self.assertEqual(sorted(f), ["llama", "qwen3"])
        self.assertEqual(f["llama"]["computed"][32768], 327.68)
        self.assertEqual(sorted(f["qwen3"]["matched"]), [1024, 4096, 8192, 16384, 32768])

    def test_a_png_that_decodes_with_both_colours(self):
        w, h, rows = decode(ttft.draw(ttft.figures(lines())))
        self.assertEqual((w, h), (900, 560))
        px = b"".join(rows)
        for rgb in ttft.COLORS[:2]:
            self.assertIn(bytes(rgb), px)

    def test_main_writes_the_file_and_refuses_no_figures(self):
        d = tempfile.mkdtemp()
        raw, out = os.path.join(d, "hf-raw.txt"), os.path.join(d, "ttft.png")
        with open(raw, "w") as f:
            f.write("\n".join(lines()) + "\n")
        with redirect_stdout(io.StringIO()) as o:
            self.assertEqual(ttft.main([raw, "--out", out]), 0)
        self.assertIn("llama matched: 1024 tokens", o.getvalue())
        decode(open(out, "rb").read())
        with open(raw, "w") as f:
            f.write("meta hf-new 64\n")
        with redirect_stderr(io.StringIO()) as e:
            self.assertEqual(ttft.main([raw, "--out", out]), 1)
        self.assertIn("no ttft figures", e.getvalue())


if __name__ == "__main__":
    unittest.main()
