"""Small PNG charts drawn with PIL (bar and line), so reports need no plotting dependency."""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
           (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]
W, H, M = 720, 420, 60


def _frame(title: str, ymax: float, ylabel: str):
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    f = ImageFont.load_default(size=14)
    d.text((W // 2, 16), title, fill="black", font=f, anchor="mm")
    d.line([(M, 30), (M, H - M), (W - 20, H - M)], fill="black", width=1)
    for k in range(5):
        v = ymax * k / 4
        y = H - M - (H - M - 30) * k / 4
        d.line([(M - 4, y), (W - 20, y)], fill=(225, 225, 225))
        d.text((M - 8, y), f"{v:.2f}", fill="black", font=ImageFont.load_default(size=11), anchor="rm")
    d.text((12, 30), ylabel, fill="black", font=ImageFont.load_default(size=11), anchor="lm")
    return img, d


def bar_chart(path: str | Path, title: str, groups: list[str], series: dict[str, list[float]], ylabel: str = "") -> Path:
    """Grouped bars: ``series[name][i]`` is the bar of ``name`` in group ``groups[i]``."""
    ymax = max([v for vals in series.values() for v in vals] + [1e-9]) * 1.1
    img, d = _frame(title, ymax, ylabel)
    small = ImageFont.load_default(size=11)
    n = max(len(series), 1)
    gw = (W - 20 - M) / max(len(groups), 1)
    bw = gw * 0.8 / n
    for gi, g in enumerate(groups):
        x0 = M + gi * gw + gw * 0.1
        for si, (name, vals) in enumerate(series.items()):
            v = vals[gi] if gi < len(vals) else 0.0
            top = H - M - (H - M - 30) * v / ymax
            d.rectangle([x0 + si * bw, top, x0 + (si + 1) * bw - 2, H - M], fill=PALETTE[si % len(PALETTE)])
        d.text((M + gi * gw + gw / 2, H - M + 12), g, fill="black", font=small, anchor="mm")
    _legend(d, list(series))
    out = Path(path)
    img.save(out)
    return out


def line_chart(path: str | Path, title: str, xs: list[float], series: dict[str, list[float]], ylabel: str = "",
               xlabel: str = "") -> Path:
    ymax = max([v for vals in series.values() for v in vals] + [1e-9]) * 1.1
    img, d = _frame(title, ymax, ylabel)
    small = ImageFont.load_default(size=11)
    xmin, xmax = min(xs), max(xs)
    span = (xmax - xmin) or 1.0

    def px(x, y):
        return M + (W - 40 - M) * (x - xmin) / span + 10, H - M - (H - M - 30) * y / ymax

    for x in xs:
        d.text((px(x, 0)[0], H - M + 12), f"{x:g}", fill="black", font=small, anchor="mm")
    d.text((W // 2, H - 20), xlabel, fill="black", font=small, anchor="mm")
    for si, (name, vals) in enumerate(series.items()):
        pts = [px(x, y) for x, y in zip(xs, vals)]
        col = PALETTE[si % len(PALETTE)]
        if len(pts) > 1:
            d.line(pts, fill=col, width=2)
        for p in pts:
            d.ellipse([p[0] - 3, p[1] - 3, p[0] + 3, p[1] + 3], fill=col)
    _legend(d, list(series))
    out = Path(path)
    img.save(out)
    return out


def stacked_bar_chart(path: str | Path, title: str, groups: list[str], parts: dict[str, list[float]],
                      ylabel: str = "") -> Path:
    """One bar per group, split into ``parts[name][i]`` stacked bottom to top (e.g. draft / verify / other)."""
    totals = [sum((vals[gi] if gi < len(vals) else 0.0) for vals in parts.values()) for gi in range(len(groups))]
    ymax = max(totals + [1e-9]) * 1.1
    img, d = _frame(title, ymax, ylabel)
    small = ImageFont.load_default(size=11)
    gw = (W - 190 - M) / max(len(groups), 1)  # leave the legend's column free
    for gi, g in enumerate(groups):
        x0, base = M + gi * gw + gw * 0.15, 0.0
        for si, vals in enumerate(parts.values()):
            v = vals[gi] if gi < len(vals) else 0.0
            y_lo = H - M - (H - M - 30) * base / ymax
            y_hi = H - M - (H - M - 30) * (base + v) / ymax
            d.rectangle([x0, y_hi, x0 + gw * 0.7, y_lo], fill=PALETTE[si % len(PALETTE)])
            base += v
        d.text((M + gi * gw + gw / 2, H - M + 12 + 12 * (gi % 2)), g, fill="black", font=small, anchor="mm")
    _legend(d, list(parts))
    out = Path(path)
    img.save(out)
    return out

def _legend(d: ImageDraw.ImageDraw, names: list[str]) -> None:
    f = ImageFont.load_default(size=11)
    for i, name in enumerate(names):
        y = 36 + i * 15
        d.rectangle([W - 170, y - 5, W - 160, y + 5], fill=PALETTE[i % len(PALETTE)])
        d.text((W - 155, y), name, fill="black", font=f, anchor="lm")
