"""Draws bench/ttft.png: time to first token by prompt length, computed vs matched in
the pool's GPU tier, for each architecture of examples/hf/check.py's lines (impl "hf":
ttft/computed/ARCH/L and ttft/matched/ARCH/L, and ttft/restored/ARCH/L where a run has
them), with the standard library alone (the PNG is written with zlib).

    python3 bench/ttft.py HF-RAW [--out bench/ttft.png]

Both axes are logarithmic: prompt lengths 1k to 32k across, milliseconds up. Exits 1
if the raw file has no TTFT figures.
"""

import struct
import sys
import zlib

# A 5x7 font of the characters the chart writes: 7 rows of 5 pixels ("#" on).
_FONT = {
    "a": ".....|.....|.###.|....#|.####|#...#|.####", "b": "#....|#....|#.##.|##..#|#...#|#...#|####.",
    "c": ".....|.....|.###.|#....|#....|#...#|.###.", "d": "....#|....#|.##.#|#..##|#...#|#...#|.####",
    "e": ".....|.....|.###.|#...#|#####|#....|.###.", "f": "..##.|.#..#|.#...|###..|.#...|.#...|.#...",
    "g": ".....|.####|#...#|#...#|.####|....#|.###.", "h": "#....|#....|#.##.|##..#|#...#|#...#|#...#",
    "i": "..#..|.....|.##..|..#..|..#..|..#..|.###.", "k": "#....|#....|#..#.|#.#..|##...|#.#..|#..#.",
    "l": ".##..|..#..|..#..|..#..|..#..|..#..|.###.", "m": ".....|.....|##.#.|#.#.#|#.#.#|#...#|#...#",
    "n": ".....|.....|#.##.|##..#|#...#|#...#|#...#", "o": ".....|.....|.###.|#...#|#...#|#...#|.###.",
    "p": ".....|.....|####.|#...#|####.|#....|#....", "q": ".....|.....|.####|#...#|.####|....#|....#",
    "r": ".....|.....|#.##.|##..#|#....|#....|#....", "s": ".....|.....|.####|#....|.###.|....#|####.",
    "t": ".#...|.#...|###..|.#...|.#...|.#..#|..##.", "u": ".....|.....|#...#|#...#|#...#|#..##|.##.#",
    "w": ".....|.....|#...#|#...#|#.#.#|#.#.#|.#.#.",
    "0": ".###.|#...#|#..##|#.#.#|##..#|#...#|.###.", "1": "..#..|.##..|..#..|..#..|..#..|..#..|.###.",
    "2": ".###.|#...#|....#|...#.|..#..|.#...|#####", "3": "#####|...#.|..#..|...#.|....#|#...#|.###.",
    "4": "...#.|..##.|.#.#.|#..#.|#####|...#.|...#.", "5": "#####|#....|####.|....#|....#|#...#|.###.",
    "6": "..##.|.#...|#....|####.|#...#|#...#|.###.", "7": "#####|....#|...#.|..#..|.#...|.#...|.#...",
    "8": ".###.|#...#|#...#|.###.|#...#|#...#|.###.", "9": ".###.|#...#|#...#|.####|....#|...#.|.##..",
    "(": "...#.|..#..|.#...|.#...|.#...|..#..|...#.", ")": ".#...|..#..|...#.|...#.|...#.|..#..|.#...",
    ",": ".....|.....|.....|.....|.##..|..#..|.#...", ".": ".....|.....|.....|.....|.....|.##..|.##..",
    "-": ".....|.....|.....|#####|.....|.....|.....",
}


def _glyph(c):
    """The 7 rows of c (a blank for a character the font lacks)."""
    return _FONT.get(c, ".....|.....|.....|.....|.....|.....|.....").split("|")


class Canvas:
    def __init__(self, w, h):
        self.w, self.h = w, h
        self.px = bytearray(b"\xff" * (w * h * 3))

    def dot(self, x, y, rgb):
        x, y = int(round(x)), int(round(y))
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * (y * self.w + x)
            self.px[i:i + 3] = bytes(rgb)

    def line(self, x0, y0, x1, y1, rgb, width=1, dash=0):
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for i in range(n + 1):
            if dash and (i // dash) % 2:
                continue
            t = i / max(n, 1)
            x, y = x0 + (x1 - x0) * t, y0 + (y1 - y0) * t
            for dx in range(-(width // 2), width - width // 2):
                for dy in range(-(width // 2), width - width // 2):
                    self.dot(x + dx, y + dy, rgb)

    def text(self, x, y, s, rgb=(0, 0, 0), scale=2):
        for k, c in enumerate(s):
            for r, row in enumerate(_glyph(c)):
                for col, p in enumerate(row):
                    if p == "#":
                        for sx in range(scale):
                            for sy in range(scale):
                                self.dot(x + (6 * k + col) * scale + sx, y + r * scale + sy, rgb)

    def png(self):
        rows = b"".join(b"\x00" + bytes(self.px[3 * self.w * y:3 * self.w * (y + 1)]) for y in range(self.h))

        def chunk(kind, data):
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)) +
                chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b""))


def figures(lines):
    """{arch: {kind: {L: ms}}} of the "result hf ttft/KIND/ARCH/L ms MEDIAN ..." lines."""
    out = {}
    for line in lines:
        f = line.split()
        if len(f) >= 5 and f[0] == "result" and f[1] == "hf" and f[2].startswith("ttft/") and f[3] == "ms":
            parts = f[2].split("/")
            if len(parts) == 4:
                _, kind, arch, L = parts
                out.setdefault(arch, {}).setdefault(kind, {})[int(L)] = float(f[4])
    return out


COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189)]
KINDS = (("computed", 0), ("matched", 6), ("restored", 2))  # (kind, dash)


def draw(figs, w=900, h=560):
    """The chart of figures(...) as PNG bytes."""
    import math
    c = Canvas(w, h)
    left, right, top, bottom = 90, w - 250, 50, h - 70
    lengths = sorted({L for a in figs.values() for k in a.values() for L in k})
    values = [v for a in figs.values() for k in a.values() for v in k.values() if v > 0]
    lo, hi = math.log10(min(values)) - 0.1, math.log10(max(values)) + 0.1
    lx0, lx1 = math.log2(lengths[0]) - 0.3, math.log2(lengths[-1]) + 0.3

    def X(L):
        return left + (math.log2(L) - lx0) / (lx1 - lx0) * (right - left)

    def Y(ms):
        return bottom - (math.log10(ms) - lo) / (hi - lo) * (bottom - top)

    c.line(left, top, left, bottom, (0, 0, 0), 2)
    c.line(left, bottom, right, bottom, (0, 0, 0), 2)
    for L in lengths:
        c.line(X(L), bottom, X(L), bottom + 6, (0, 0, 0))
        label = "%dk" % (L // 1024) if L >= 1024 else str(L)
        c.text(X(L) - 6 * len(label), bottom + 12, label)
    for e in range(int(math.floor(lo)), int(math.ceil(hi)) + 1):
        for m in (1, 2, 5):
            v = m * 10 ** e
            if lo <= math.log10(v) <= hi:
                c.line(left - 6, Y(v), right, Y(v), (225, 225, 225) if m > 1 else (190, 190, 190))
                label = ("%g" % v)
                c.text(left - 12 - 12 * len(label), Y(v) - 7, label)
    c.text(left, 12, "time to first token, ms (log)", scale=2)
    c.text(right - 260, h - 30, "prompt tokens (log)", scale=2)
    k = 0
    for i, (arch, kinds) in enumerate(sorted(figs.items())):
        rgb = COLORS[i % len(COLORS)]
        for kind, dash in KINDS:
            pts = sorted(kinds.get(kind, {}).items())
            if not pts:
                continue
            for (a, va), (b, vb) in zip(pts, pts[1:]):
                c.line(X(a), Y(va), X(b), Y(vb), rgb, 3, dash)
            for L, v in pts:
                for d in range(-4, 5):
                    c.line(X(L) - 4, Y(v) + d, X(L) + 4, Y(v) + d, rgb)
            y = top + 10 + 28 * k
            c.line(right + 20, y + 7, right + 60, y + 7, rgb, 3, dash)
            c.text(right + 70, y, "%s %s" % (arch, kind), scale=2)
            k += 1
    return c.png()


def main(argv):
    out, raws = "bench/ttft.png", []
    it = iter(argv)
    for a in it:
        if a == "--out":
            out = next(it, None)
            if out is None:
                print("--out needs a file", file=sys.stderr)
                return 2
        else:
            raws.append(a)
    if not raws:
        print(__doc__.strip().splitlines()[-4], file=sys.stderr)
        return 2
    lines = []
    for p in raws:
        with open(p) as f:
            lines += f.read().splitlines()
    figs = figures(lines)
    if not figs:
        print("no ttft figures of impl hf in %s" % ", ".join(raws), file=sys.stderr)
        return 1
    with open(out, "wb") as f:
        f.write(draw(figs))
    for arch, kinds in sorted(figs.items()):
        for kind, pts in sorted(kinds.items()):
            print("%s %s: %s" % (arch, kind, ", ".join("%d tokens %.2f ms" % kv for kv in sorted(pts.items()))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
