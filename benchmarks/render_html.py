"""Render the HTML report of a buggy target to a PNG with headless Chromium and check the picture.

    python benchmarks/render_html.py [--out report.png] [--html report.html] [--from-html existing.html]

Checks the example target ``examples/buggy_attention.py:attention`` plus a mask-polarity bug (so
masked cells appear), writes the self-contained HTML, screenshots it with headless Chromium (no
network: every network feature is switched off), and checks the PNG is a real picture: a valid
PNG of the requested size whose pixels are not all one colour. Exit 0 ok, 1 bad picture,
77 no Chromium on this machine (a skip).
"""
from __future__ import annotations

import argparse
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--window-size=1200,1600"]


def chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def mask_ignoring_polarity(Q, K, V, mask=None):
    """A learner's bug: masked_fill(mask, -inf) masks the keys the mask allows."""
    scores = Q @ K.transpose(-2, -1) / Q.size(-1) ** 0.5
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    return scores.softmax(dim=-1) @ V


def build_report_html() -> str:
    import attn_spec
    from attn_spec.report import render
    from attn_spec.targets.loading import load_target

    buggy = load_target(f"{REPO / 'examples' / 'buggy_attention.py'}:attention")
    report = attn_spec.check(mask_ignoring_polarity, buggy, profile="quick", seed=3, devices=["cpu"],
                             only=["rows-sum-to-one", "scale-sqrt-dk", "causal-mask"])
    return render(report, "html")


def png_pixels(data: bytes) -> tuple[int, int, set]:
    """(width, height, set of distinct pixel rows' bytes) from an 8-bit RGB/RGBA PNG, stdlib only."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", chunk[:10])
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    raw = zlib.decompress(idat)
    channels = {2: 3, 6: 4}.get(colour, 0)
    if depth != 8 or not channels:
        raise ValueError(f"unsupported PNG format (bit depth {depth}, colour type {colour})")
    stride = width * channels + 1
    # Filter bytes make rows hard to compare raw; count distinct filtered rows and distinct bytes instead.
    rows = {raw[i * stride + 1:(i + 1) * stride] for i in range(height)}
    return width, height, rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "attn-spec-report.png"))
    parser.add_argument("--html", default=str(Path(tempfile.gettempdir()) / "attn-spec-report.html"))
    parser.add_argument("--from-html", metavar="FILE", help="render this existing report instead of checking the "
                                                           "example targets")
    args = parser.parse_args(argv)
    browser = chromium()
    if not browser:
        print("render_html: no chromium on this machine: skipped")
        return 77
    if args.from_html:
        args.html = args.from_html
    else:
        Path(args.html).write_text(build_report_html(), encoding="utf-8")
    Path(args.out).unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="attn-spec-chromium-") as profile:
        subprocess.run([browser, *FLAGS, f"--user-data-dir={profile}", f"--screenshot={args.out}",
                        Path(args.html).resolve().as_uri()], check=False, timeout=120,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not Path(args.out).exists():
        print(f"render_html: chromium wrote no screenshot to {args.out}")
        return 1
    width, height, rows = png_pixels(Path(args.out).read_bytes())
    distinct = len({bytes(r) for r in rows})
    print(f"render_html: {args.html} -> {args.out}: {width}x{height}, {distinct} distinct pixel rows")
    if (width, height) != (1200, 1600) or distinct < 50:
        print("render_html: the picture is empty or uniform")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
