"""Task metrics of streamed frames against the analytic ground truth (:mod:`.data`).

All frames are RGB ``float32 [T, 16, 16, 3]`` in ``[0, 1]`` (:func:`~.data.to_rgb`).

A sprite is *clear* at ``t`` when it lies wholly inside the view and no other sprite overlaps
its box (ground truth; :func:`clear`): only clear sprites are scored.

``tracking``
    For every frame ``t`` in a range and every clear sprite,
    the sprite is searched over the *whole* frame: the top-left ``(x, y)`` minimising the mean
    squared error between the frame's pixels under the sprite's shape mask and its colour
    (:func:`match_sprite`). It is *found* when that error is ``<= PRESENT_MSE`` and *tracked*
    when also within ``TRACK_TOL`` pixels (Chebyshev) of the true position.
``re-entry``
    A sprite wholly visible at ``t1``, then wholly outside the view for ``>= min_gap``
    frames, then wholly visible again at ``t2`` (the first such frame, if it is clear) is a re-entry
    event. At ``t2`` the sprite is searched within ``REENTRY_SEARCH`` pixels of its true
    position; the event scores ``colour_ok`` (the mean colour under the mask is nearest to
    the true colour among :data:`~.data.SPRITE_PALETTE`), ``shape_ok`` (the pixels of the
    box closer to the sprite's colour than to the true background form the true shape
    best, by IoU among :data:`~.data.SHAPES`) and ``position_ok`` (found and within
    ``TRACK_TOL``). Chance levels: colour 1/8, shape 1/3.
``revisit``
    A world column visible at ``t2``, not visible at some frame ``h < t2``, and visible
    at a frame before ``h`` (the last one: ``t1``) is revisited at ``t2`` with gap ``t2 -
    t1 >= min_gap``. Scored on its background pixels (rows no sprite covers, dilated by
    one pixel, at ``t1`` nor ``t2``): mean absolute error against the true background
    (``bg_err``) and against the same stream's pixels of that world column at ``t1``
    (``consistency``: does the region look as it did). ``ok`` when ``bg_err <= REVISIT_TOL``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .data import SHAPES, SPRITE, SPRITE_PALETTE, VIEW, Truth

__all__ = ["clear", "TRACK_TOL", "PRESENT_MSE", "REENTRY_SEARCH", "REVISIT_TOL", "match_sprite", "tracking",
           "reentry_events", "reentry_scores", "revisit_events", "revisit_scores", "ReentryEvent", "RevisitEvent"]

TRACK_TOL = 1  # pixels (Chebyshev)
PRESENT_MSE = 0.03  # mean squared RGB error under the mask, per channel
REENTRY_SEARCH = 2  # pixels around the true position
REVISIT_TOL = 0.1  # mean absolute RGB error, per channel


def clear(truth: Truth) -> np.ndarray:
    """bool ``[T, K]``: sprite ``k`` wholly inside the view and no other sprite's box overlapping its own."""
    w = truth.world
    out = truth.full.copy()
    for k in range(w.shape[1]):
        for j in range(w.shape[1]):
            if j != k:
                out[:, k] &= np.abs(w[:, j] - w[:, k]).max(-1) >= SPRITE
    return out


def match_sprite(frame: np.ndarray, colour: np.ndarray, shape: int, around: tuple[int, int] | None = None,
                 radius: int | None = None) -> tuple[int, int, float]:
    """``(x, y, mse)``: the top-left (wholly inside the frame, within ``radius`` of
    ``around`` if given) minimising the mean squared error under the shape mask."""
    n = VIEW - SPRITE + 1
    mask = SHAPES[shape]
    best = (0, 0, np.inf)
    for y in range(n):
        for x in range(n):
            if around is not None and max(abs(x - around[0]), abs(y - around[1])) > radius:
                continue
            err = float(((frame[y : y + SPRITE, x : x + SPRITE][mask] - colour) ** 2).mean())
            if err < best[2]:
                best = (x, y, err)
    return best


def tracking(frames: np.ndarray, truth: Truth, t_range: range) -> dict[str, float | int]:
    """Tracking over ``t_range`` (see the module docstring): counts and rates, and the mean
    position error of found sprites."""
    n = found = tracked = 0
    errs = []
    ok = clear(truth)
    for t in t_range:
        for k in range(truth.colours.shape[0]):
            if not ok[t, k]:
                continue
            x, y, mse = match_sprite(frames[t], truth.colours[k], int(truth.shapes[k]))
            n += 1
            err = max(abs(x - int(truth.view[t, k, 0])), abs(y - int(truth.view[t, k, 1])))
            if mse <= PRESENT_MSE:
                found += 1
                errs.append(err)
                tracked += err <= TRACK_TOL
    return {"n": n, "found": found, "tracked": tracked, "tracked_rate": tracked / n if n else float("nan"),
            "mean_err_found": float(np.mean(errs)) if errs else float("nan")}


@dataclass(frozen=True)
class ReentryEvent:
    sprite: int
    t_last: int  # last frame wholly visible before leaving
    t_back: int  # first frame wholly visible again
    hidden: int  # frames wholly outside the view in between


def reentry_events(truth: Truth, *, min_gap: int = 2, start: int = 0) -> list[ReentryEvent]:
    """Re-entries with ``t_back >= start`` (see the module docstring)."""
    out = []
    ok = clear(truth)
    for k in range(truth.colours.shape[0]):
        last_full, hidden = None, 0
        for t in range(truth.frames):
            if truth.full[t, k]:
                if last_full is not None and hidden >= min_gap and t >= start and ok[t, k]:
                    out.append(ReentryEvent(k, last_full, t, hidden))
                last_full, hidden = t, 0
            elif not truth.any[t, k]:
                hidden += 1
    return out


def _shape_of(box: np.ndarray, colour: np.ndarray, background: np.ndarray) -> int:
    sprite_like = ((box - colour) ** 2).sum(-1) < ((box - background) ** 2).sum(-1)
    ious = [(sprite_like & m).sum() / max(1, (sprite_like | m).sum()) for m in SHAPES]
    return int(np.argmax(ious))


def reentry_scores(frames: np.ndarray, truth: Truth, events: list[ReentryEvent]) -> list[dict]:
    """Per event: ``colour_ok``, ``shape_ok``, ``position_ok``, the match error and offset."""
    out = []
    for ev in events:
        t, k = ev.t_back, ev.sprite
        gx, gy = int(truth.view[t, k, 0]), int(truth.view[t, k, 1])
        colour, shape = truth.colours[k], int(truth.shapes[k])
        x, y, mse = match_sprite(frames[t], colour, shape, around=(gx, gy), radius=REENTRY_SEARCH)
        box = frames[t][y : y + SPRITE, x : x + SPRITE]
        mean = box[SHAPES[shape]].mean(0)
        nearest = int(np.argmin(((SPRITE_PALETTE - mean) ** 2).sum(-1)))
        cam = int(truth.cam[t])
        bg = truth.background[y : y + SPRITE, cam + x : cam + x + SPRITE]
        off = max(abs(x - gx), abs(y - gy))
        out.append({
            "sprite": k, "t_last": ev.t_last, "t_back": t, "hidden": ev.hidden, "mse": mse, "offset": off,
            "colour_ok": bool(np.allclose(SPRITE_PALETTE[nearest], colour)),
            "shape_ok": _shape_of(box, colour, bg) == shape,
            "position_ok": bool(mse <= PRESENT_MSE and off <= TRACK_TOL),
        })
    return out


@dataclass(frozen=True)
class RevisitEvent:
    t_back: int
    t_last: int
    column: int  # world column


def revisit_events(truth: Truth, *, min_gap: int = 4, start: int = 0) -> list[RevisitEvent]:
    """Revisited world columns at frames ``>= start`` (see the module docstring)."""
    out = []
    width = truth.background.shape[1]
    for w in range(width):
        vis = (truth.cam <= w) & (w < truth.cam + VIEW)
        last_vis, left = None, False
        for t in range(truth.frames):
            if vis[t]:
                if left and last_vis is not None and t - last_vis >= min_gap and t >= start:
                    out.append(RevisitEvent(t, last_vis, w))
                left, last_vis = False, t
            else:
                left = True
    return out


def _sprite_rows(truth: Truth, t: int, w: int) -> np.ndarray:
    """bool ``[H]``: rows of world column ``w`` that a sprite's box (dilated by 1) covers at ``t``."""
    rows = np.zeros(truth.background.shape[0], dtype=bool)
    for k in range(truth.colours.shape[0]):
        x, y = truth.world[t, k]
        if x - 1 <= w <= x + SPRITE:
            rows[max(0, y - 1) : y + SPRITE + 1] = True
    return rows


def revisit_scores(frames: np.ndarray, truth: Truth, events: list[RevisitEvent]) -> list[dict]:
    """Per event: ``bg_err``, ``consistency``, ``ok`` (see the module docstring); events
    whose column is wholly covered by sprites are skipped."""
    out = []
    for ev in events:
        rows = ~(_sprite_rows(truth, ev.t_back, ev.column) | _sprite_rows(truth, ev.t_last, ev.column))
        if not rows.any():
            continue
        now = frames[ev.t_back][rows, ev.column - int(truth.cam[ev.t_back])]
        then = frames[ev.t_last][rows, ev.column - int(truth.cam[ev.t_last])]
        bg = truth.background[rows, ev.column]
        err = float(np.abs(now - bg).mean())
        out.append({"t_back": ev.t_back, "t_last": ev.t_last, "column": ev.column, "gap": ev.t_back - ev.t_last,
                    "bg_err": err, "consistency": float(np.abs(now - then).mean()), "ok": err <= REVISIT_TOL})
    return out
