"""Procedural video clips with analytic ground truth: a grid world wider than the view, a
camera that pans across it and back, sprites that bounce off the world's walls.

Everything lives on a grid of ``CELL x CELL``-pixel cells (4 x 4: one token of the toy
model's 4 x 4 patches), and everything moves by whole cells, one per frame::

    world: 4 x 12 cells (16 x 48 px)          view: 4 x 4 cells (16 x 16 px) at cell column cam

- **Background**: the world's columns are cut into ``BANDS`` vertical bands of two cells;
  each band gets a colour drawn (with repetition) from :data:`BACKGROUND_PALETTE` per clip.
- **Camera**: ``cam`` starts at a cell in ``[0, 8]`` and moves by one cell per frame,
  reflecting off both ends (a triangle wave of period 16 frames): every region the view
  leaves comes back into it later (the *revisit*).
- **Sprites**: one cell each, a shape from :data:`SHAPES` and a colour from
  :data:`SPRITE_PALETTE` (distinct within a clip), velocities ``vx`` in ``±1`` and ``vy`` in
  ``{-1, 0, 1}`` cells per frame, reflecting off the world's walls. A sprite leaves the view
  when the camera or its own motion takes it out, and re-enters later with the same colour
  and shape (the *re-entry*).

Motion is integer and reflection is exact (``p -> -p`` below 0, ``p -> 2 * max - p`` above
``max``, the velocity flips), so every frame, every position and every visibility is known
exactly (:class:`Truth`; positions are reported in pixels). Whole-cell motion keeps every
frame a grid of tokens that attention can copy; a first version with 1-2 pixel (sub-token)
motion did not train to sharp frames within the CPU budget. A clip is a pure function of
``(seed, index)`` (NumPy ``PCG64`` seeded with ``[seed, index]``): training and evaluation
draw from disjoint seeds.

Frames map to the DiT's latent space without a VAE: RGB in ``[0, 1]`` -> ``2 x - 1``, so a
clip is ``[3, T, 16, 16]`` float32 in ``[-1, 1]`` (``in_channels=3``; the model's 4 x 4 patch
makes a 4 x 4 grid of tokens per frame).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "CELL", "VIEW", "WORLD_H", "WORLD_W", "SPRITE", "BANDS", "SHAPES", "SHAPE_NAMES", "SPRITE_PALETTE",
    "BACKGROUND_PALETTE", "Sprite", "Scene", "Truth", "sample_scene", "simulate", "render", "make_clip",
    "make_batch", "sprite_mask", "to_latents", "to_rgb",
]

CELL = 4
VIEW = 4 * CELL
WORLD_H = 4 * CELL
WORLD_W = 12 * CELL
SPRITE = CELL
BANDS = 6

SHAPE_NAMES = ("square", "hollow", "cross")
#: bool [3, 4, 4] masks: a filled square, its border, its two diagonals
SHAPES = np.stack([
    np.ones((SPRITE, SPRITE), dtype=bool),
    np.pad(np.zeros((SPRITE - 2, SPRITE - 2), dtype=bool), 1, constant_values=True),
    np.eye(SPRITE, dtype=bool) | np.fliplr(np.eye(SPRITE, dtype=bool)),
])

#: saturated sprite colours (RGB in [0, 1])
SPRITE_PALETTE = np.array([
    [1.0, 0.15, 0.15], [0.2, 1.0, 0.2], [0.25, 0.45, 1.0], [1.0, 0.95, 0.2],
    [1.0, 0.3, 1.0], [0.2, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 0.6, 0.1],
], dtype=np.float32)
#: muted background colours, far from every sprite colour
BACKGROUND_PALETTE = np.array([
    [0.05, 0.05, 0.25], [0.05, 0.25, 0.08], [0.3, 0.18, 0.08], [0.3, 0.3, 0.3],
    [0.22, 0.05, 0.28], [0.04, 0.2, 0.22], [0.25, 0.25, 0.05], [0.02, 0.02, 0.02],
], dtype=np.float32)


@dataclass(frozen=True)
class Sprite:
    """One sprite: shape index, colour index, world cell of its top-left at frame 0,
    velocity in cells per frame."""

    shape: int
    colour: int
    x: int
    y: int
    vx: int
    vy: int


@dataclass(frozen=True)
class Scene:
    """Everything a clip is drawn from: band colour indices, the camera's start cell and
    velocity (cells per frame), the sprites (drawn in order: later ones on top)."""

    bands: tuple[int, ...]
    cam_x: int
    cam_v: int
    sprites: tuple[Sprite, ...]


@dataclass(frozen=True)
class Truth:
    """Ground truth of ``T`` frames (NumPy arrays).

    ``cam``: int ``[T]`` the view's first world column. ``world``: int ``[T, K, 2]`` each
    sprite's top-left (x, y) in the world. ``view``: int ``[T, K, 2]`` the same in view
    pixels (``x - cam``). ``full``: bool ``[T, K]`` the sprite lies wholly inside the view;
    ``any``: bool ``[T, K]`` at least one of its pixels does. ``colours``: float32 ``[K, 3]``;
    ``shapes``: int ``[K]``; ``background``: float32 ``[WORLD_H, WORLD_W, 3]`` (sprites absent).
    """

    cam: np.ndarray
    world: np.ndarray
    view: np.ndarray
    full: np.ndarray
    any: np.ndarray
    colours: np.ndarray
    shapes: np.ndarray
    background: np.ndarray

    @property
    def frames(self) -> int:
        return int(self.cam.shape[0])


def _reflect(p: int, v: int, hi: int) -> tuple[int, int]:
    """One step of motion in ``[0, hi]`` with exact reflection (``|v| <= hi``)."""
    p += v
    if p < 0:
        return -p, -v
    if p > hi:
        return 2 * hi - p, -v
    return p, v


def sample_scene(rng: np.random.Generator, sprites: int = 2) -> Scene:
    """A random scene: ``sprites`` sprites of distinct colours (1 <= sprites <= 8)."""
    if not 1 <= sprites <= len(SPRITE_PALETTE):
        raise ValueError(f"sprites must be in [1, {len(SPRITE_PALETTE)}], got {sprites}")
    bands = tuple(int(b) for b in rng.integers(0, len(BACKGROUND_PALETTE), BANDS))
    cam_x = int(rng.integers(0, (WORLD_W - VIEW) // CELL + 1))
    cam_v = int(rng.choice([-1, 1]))
    colours = rng.permutation(len(SPRITE_PALETTE))[:sprites]
    out = []
    for c in colours:
        out.append(Sprite(
            shape=int(rng.integers(0, len(SHAPES))), colour=int(c),
            x=int(rng.integers(0, (WORLD_W - SPRITE) // CELL + 1)), y=int(rng.integers(0, (WORLD_H - SPRITE) // CELL + 1)),
            vx=int(rng.choice([-1, 1])), vy=int(rng.choice([-1, 0, 1])),
        ))
    return Scene(bands=bands, cam_x=cam_x, cam_v=cam_v, sprites=tuple(out))


def simulate(scene: Scene, frames: int) -> Truth:
    """The ground truth of ``frames`` frames of ``scene`` (see :class:`Truth`)."""
    if frames < 1:
        raise ValueError(f"frames must be >= 1, got {frames}")
    k = len(scene.sprites)
    cam = np.zeros(frames, dtype=np.int64)
    world = np.zeros((frames, k, 2), dtype=np.int64)
    c, cv = scene.cam_x, scene.cam_v
    state = [(s.x, s.y, s.vx, s.vy) for s in scene.sprites]
    for t in range(frames):
        cam[t] = c * CELL
        for i, (x, y, vx, vy) in enumerate(state):
            world[t, i] = (x * CELL, y * CELL)
        c, cv = _reflect(c, cv, (WORLD_W - VIEW) // CELL)
        nxt = []
        for x, y, vx, vy in state:
            x, vx = _reflect(x, vx, (WORLD_W - SPRITE) // CELL)
            y, vy = _reflect(y, vy, (WORLD_H - SPRITE) // CELL)
            nxt.append((x, y, vx, vy))
        state = nxt
    view = world.copy()
    view[..., 0] -= cam[:, None]
    vx = view[..., 0]
    full = (vx >= 0) & (vx <= VIEW - SPRITE)
    anyv = (vx > -SPRITE) & (vx < VIEW)
    band_w = WORLD_W // BANDS
    background = np.repeat(BACKGROUND_PALETTE[list(scene.bands)], band_w, axis=0)[None].repeat(WORLD_H, axis=0)
    return Truth(
        cam=cam, world=world, view=view, full=full, any=anyv,
        colours=SPRITE_PALETTE[[s.colour for s in scene.sprites]], shapes=np.array([s.shape for s in scene.sprites]),
        background=background.astype(np.float32),
    )


def render(scene: Scene, truth: Truth) -> np.ndarray:
    """RGB frames ``float32 [T, VIEW, VIEW, 3]`` in ``[0, 1]``."""
    frames = truth.frames
    out = np.empty((frames, VIEW, VIEW, 3), dtype=np.float32)
    for t in range(frames):
        c = int(truth.cam[t])
        world = truth.background.copy()
        for i, s in enumerate(scene.sprites):
            x, y = truth.world[t, i]
            box = world[y : y + SPRITE, x : x + SPRITE]
            box[SHAPES[s.shape]] = truth.colours[i]
        out[t] = world[:, c : c + VIEW]
    return out


def make_clip(seed: int, index: int, frames: int, sprites: int = 2) -> tuple[Scene, Truth, np.ndarray]:
    """Clip ``index`` of stream ``seed``: ``(scene, truth, rgb [T, 16, 16, 3])``, a pure
    function of its arguments."""
    rng = np.random.default_rng([int(seed), int(index)])
    scene = sample_scene(rng, sprites)
    truth = simulate(scene, frames)
    return scene, truth, render(scene, truth)


def to_latents(rgb: np.ndarray | Tensor) -> Tensor:
    """RGB ``[..., T, H, W, 3]`` in ``[0, 1]`` -> latents ``float32 [..., 3, T, H, W]`` in ``[-1, 1]``."""
    x = torch.as_tensor(np.asarray(rgb, dtype=np.float32)) if not isinstance(rgb, Tensor) else rgb.float()
    return (x * 2 - 1).movedim(-1, -4).contiguous()


def to_rgb(latents: Tensor) -> np.ndarray:
    """Latents ``[..., 3, T, H, W]`` -> RGB ``float32 [..., T, H, W, 3]`` clipped to ``[0, 1]``."""
    x = (latents.detach().float().cpu().movedim(-4, -1) + 1) / 2
    return x.clamp(0, 1).numpy()


def sprite_mask(truth: Truth, rgb: np.ndarray) -> np.ndarray:
    """bool ``[T, VIEW, VIEW]``: the pixels where a sprite covers the background."""
    bg = np.stack([truth.background[:, c : c + VIEW] for c in truth.cam.tolist()])
    return (rgb != bg).any(-1)


def make_batch(seed: int, indices: range | list[int], frames: int, sprites: int = 2) -> tuple[Tensor, Tensor]:
    """Latents ``float32 [B, 3, T, 16, 16]`` of clips ``indices`` of stream ``seed``, and
    their sprite masks ``bool [B, 1, T, 16, 16]`` (:func:`sprite_mask`)."""
    clips = [make_clip(seed, i, frames, sprites) for i in indices]
    x = torch.stack([to_latents(rgb) for _, _, rgb in clips])
    masks = torch.stack([torch.from_numpy(sprite_mask(truth, rgb)) for _, truth, rgb in clips])
    return x, masks[:, None]
