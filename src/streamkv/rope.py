"""Wan-style 3D rotary position embedding.

The head dimension ``D`` is split into three bands of rotated pairs: time gets
``D - 4 * (D // 6)`` channels, height and width ``2 * (D // 6)`` each (Wan 2.1's split).
Each band rotates consecutive channel pairs ``(x[2i], x[2i+1])`` by ``coord * freq_i``
with ``freq_i = theta ** (-2i / band)``.

A stream position ``p`` maps to the grid coordinate
``(frame, row, col) = (p // tokens_per_frame, (p % tokens_per_frame) // grid_w, p % grid_w)``.

The table covers ``max_frames`` frames (Wan: 1,024, about 4 min 15 s at 16 fps). A
position beyond it raises ``ValueError`` instead of aliasing to an earlier angle.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from .validate import check_int

__all__ = ["Rope3D"]


class Rope3D:
    """Angle tables and rotation for ``head_dim``-channel heads on a ``grid_h x grid_w`` frame.

    Args:
        head_dim: channels per head (even, >= 6).
        grid_h, grid_w: tokens per frame along height and width.
        max_frames: frames the time table covers (the position horizon).
        theta: RoPE base.
    """

    def __init__(self, head_dim: int, grid_h: int, grid_w: int, *, max_frames: int = 1024, theta: float = 10000.0) -> None:
        if isinstance(head_dim, int) and (head_dim < 6 or head_dim % 2):
            raise ValueError(f"head_dim must be even and >= 6, got {head_dim}")
        for name, v in (("head_dim", head_dim), ("grid_h", grid_h), ("grid_w", grid_w), ("max_frames", max_frames)):
            check_int(name, v, 1)
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 1:
            raise ValueError(f"theta must be a finite number > 1 (the RoPE base), got {theta!r}")
        if max_frames * grid_h * grid_w > 2**53:
            raise ValueError(
                f"max_frames x tokens per frame = {max_frames * grid_h * grid_w} positions: above 2**53 positions "
                f"stop being exact in float64 and distinct positions would share an angle"
            )
        self.head_dim = head_dim
        self.grid_h, self.grid_w = grid_h, grid_w
        self.tokens_per_frame = grid_h * grid_w
        self.max_frames = max_frames
        band_hw = 2 * (head_dim // 6)
        self.bands = (head_dim - 2 * band_hw, band_hw, band_hw)
        self._freqs = [theta ** (-torch.arange(0, b, 2, dtype=torch.float64) / b) for b in self.bands]

    @property
    def horizon(self) -> int:
        """First position the table cannot rotate: ``max_frames * tokens_per_frame``."""
        return self.max_frames * self.tokens_per_frame

    def check_positions(self, first: int, last: int) -> None:
        """Raise ``ValueError`` unless positions ``[first, last]`` are inside the horizon."""
        if first < 0:
            raise ValueError(f"positions must be >= 0, got {first}")
        if last >= self.horizon:
            raise ValueError(
                f"position {last} (frame {last // self.tokens_per_frame}) is beyond the RoPE horizon of "
                f"{self.max_frames} frames ({self.horizon} positions); refusing to alias it to an earlier angle"
            )

    def angles(self, positions: Tensor) -> Tensor:
        """Rotation angles ``float64 [..., head_dim // 2]`` for ``int64`` positions ``[...]``
        (integer tensors only: a float position would be truncated to another token)."""
        if not isinstance(positions, Tensor) or positions.is_floating_point() or positions.is_complex() \
                or positions.dtype == torch.bool:
            got = positions.dtype if isinstance(positions, Tensor) else type(positions).__name__
            raise TypeError(f"positions must be an integer tensor (token positions), got {got}")
        positions = positions.to(torch.long)
        if positions.numel():
            self.check_positions(int(positions.min()), int(positions.max()))
        frame = positions // self.tokens_per_frame
        within = positions % self.tokens_per_frame
        coords = (frame, within // self.grid_w, within % self.grid_w)
        parts = [c.to(torch.float64).unsqueeze(-1) * f.to(positions.device) for c, f in zip(coords, self._freqs)]
        return torch.cat(parts, dim=-1)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """``cos`` and ``sin`` tables ``[..., head_dim // 2]`` for ``positions``."""
        a = self.angles(positions)
        return a.cos().to(dtype), a.sin().to(dtype)

    @staticmethod
    def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotate channel pairs of ``x [..., L, (H,) D]`` by tables ``[L, D/2]`` (broadcast).

        ``cos``/``sin`` must broadcast against ``x[..., ::2]``; for ``x`` shaped
        ``[B, L, H, D]`` pass tables shaped ``[L, 1, D/2]``. Returns a new tensor.
        """
        x2 = x.unflatten(-1, (-1, 2))
        a, b = x2[..., 0], x2[..., 1]
        out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
        return out.flatten(-2)
