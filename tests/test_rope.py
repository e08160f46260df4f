"""Wan-style 3D RoPE: band split, relative-position property, the horizon."""

import pytest
import torch

from streamkv.rope import Rope3D


def test_wan_band_split():
    assert Rope3D(128, 30, 52).bands == (44, 42, 42)  # Wan 2.1: d - 4(d//6), 2(d//6), 2(d//6)
    assert Rope3D(16, 4, 4).bands == (8, 4, 4)


def test_rotation_preserves_norm_and_is_relative_in_time():
    rope = Rope3D(16, 2, 3, max_frames=50)
    tpf = rope.tokens_per_frame
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)

    def rot(x, pos):
        cos, sin = rope.cos_sin(torch.tensor([pos]), torch.float64)
        return Rope3D.rotate(x.view(1, 16), cos, sin).view(16)

    assert torch.allclose(rot(q, 17).norm(), q.norm())
    # same spatial cell (index 4 within the frame), frames (3, 1) and (10, 8): same offset
    a = rot(q, 3 * tpf + 4) @ rot(k, 1 * tpf + 4)
    b = rot(q, 10 * tpf + 4) @ rot(k, 8 * tpf + 4)
    c = rot(q, 10 * tpf + 4) @ rot(k, 7 * tpf + 4)
    assert torch.allclose(a, b) and not torch.allclose(a, c)


def test_positions_beyond_the_horizon_raise_instead_of_aliasing():
    rope = Rope3D(16, 2, 2, max_frames=10)
    assert rope.horizon == 40
    rope.cos_sin(torch.arange(36, 40))
    with pytest.raises(ValueError, match=r"position 41 \(frame 10\) is beyond the RoPE horizon of 10 frames \(40 positions\)"):
        rope.cos_sin(torch.arange(38, 42))


def test_bad_config():
    with pytest.raises(ValueError, match="head_dim must be even and >= 6, got 7"):
        Rope3D(7, 2, 2)
    with pytest.raises(ValueError, match="grid_w must be >= 1, got 0"):
        Rope3D(16, 2, 0)
