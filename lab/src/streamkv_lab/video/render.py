"""Pictures of streams: labelled side-by-side tiles, animated GIFs and contact sheets (Pillow).

Frames are RGB ``float32 [T, H, W, 3]`` in ``[0, 1]``; they are enlarged by an integer
factor with nearest-neighbour sampling (pixels stay sharp).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

__all__ = ["tile_frames", "write_gif", "contact_sheet"]

_LABEL_H = 14
_BORDER = 4


def _u8(rgb: np.ndarray, scale: int) -> np.ndarray:
    img = (np.clip(rgb, 0, 1) * 255 + 0.5).astype(np.uint8)
    return img.repeat(scale, axis=0).repeat(scale, axis=1)


def tile_frames(streams: Mapping[str, np.ndarray], *, scale: int = 8, horizon: int | None = None,
                context: int = 0, errors: Mapping[str, np.ndarray] | None = None) -> list:
    """One PIL image per frame: the streams side by side, each under its label, with the
    frame number and a note when the frame is ground truth (``t < context``) or past the
    training ``horizon``. Every stream must have the same number of frames. ``errors``: per
    stream, a number per frame (e.g. the error against the ground truth) printed under its tile."""
    from PIL import Image, ImageDraw

    names = list(streams)
    lengths = {len(streams[n]) for n in names}
    if len(lengths) != 1:
        raise ValueError(f"streams must have the same number of frames, got {dict((n, len(streams[n])) for n in names)}")
    t_total = lengths.pop()
    h, w = streams[names[0]].shape[1:3]
    tw, th = w * scale, h * scale
    width = len(names) * (tw + _BORDER) + _BORDER
    height = th + (3 if errors else 2) * _LABEL_H + _BORDER
    out = []
    for t in range(t_total):
        canvas = Image.new("RGB", (width, height), (24, 24, 24))
        draw = ImageDraw.Draw(canvas)
        for i, name in enumerate(names):
            x = _BORDER + i * (tw + _BORDER)
            canvas.paste(Image.fromarray(_u8(streams[name][t], scale)), (x, _LABEL_H))
            draw.text((x + 2, 1), name[: max(4, tw // 6)], fill=(235, 235, 235))
            if errors and name in errors:
                draw.text((x + 2, _LABEL_H + th + 2), f"err {float(errors[name][t]):.3f}", fill=(150, 200, 235))
        note = "ground truth context" if t < context else ("past training window" if horizon and t >= horizon else "")
        y_note = _LABEL_H + th + 2 + (_LABEL_H if errors else 0)
        draw.text((_BORDER + 2, y_note), f"frame {t:3d}  {note}", fill=(200, 200, 120))
        out.append(canvas)
    return out


def write_gif(frames: list, path: str | Path, *, fps: float = 8.0) -> Path:
    """An animated GIF that loops forever."""
    if not frames:
        raise ValueError("write_gif needs at least one frame")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=int(round(1000 / fps)), loop=0,
                   optimize=False, disposal=1)
    return path


def contact_sheet(streams: Mapping[str, np.ndarray], path: str | Path, *, every: int = 4, scale: int = 4) -> Path:
    """A PNG: one row per stream (labelled), one column per ``every``-th frame."""
    from PIL import Image, ImageDraw

    names = list(streams)
    t_total, h, w = streams[names[0]].shape[:3]
    cols = list(range(0, t_total, every))
    label_w = 120
    tw, th = w * scale, h * scale
    sheet = Image.new("RGB", (label_w + len(cols) * (tw + 2), _LABEL_H + len(names) * (th + 2)), (24, 24, 24))
    draw = ImageDraw.Draw(sheet)
    for j, t in enumerate(cols):
        draw.text((label_w + j * (tw + 2), 1), str(t), fill=(200, 200, 120))
    for i, name in enumerate(names):
        y = _LABEL_H + i * (th + 2)
        draw.text((2, y + th // 2 - 6), name[:20], fill=(235, 235, 235))
        for j, t in enumerate(cols):
            sheet.paste(Image.fromarray(_u8(streams[name][t], scale)), (label_w + j * (tw + 2), y))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)
    return path
