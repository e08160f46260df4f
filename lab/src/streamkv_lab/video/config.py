"""What ``streamkv train-toy`` and ``streamkv video-eval`` run (:class:`TrainConfig`,
:class:`EvalConfig`) and the constants they share, without importing torch (the CLI builds its
``--help`` from these defaults)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CONTEXT_FRAMES", "TrainConfig", "EvalConfig"]

#: streams are conditioned on the ground truth's first frames; the rest is generated
CONTEXT_FRAMES = 4


@dataclass(frozen=True)
class TrainConfig:
    """What :func:`train` runs (recorded beside the weights)."""

    seed: int = 0
    steps: int = 2400
    batch: int = 8
    frames: int = 16  # the training window: frames per clip
    sprites: int = 2
    lr: float = 2e-3
    warmup: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    ema: float = 0.995
    discrete_sigma_prob: float = 0.5
    sigma_min: float = 0.02
    sprite_weight: float = 1.0  # loss weight of the pixels a sprite covers (1: plain MSE)
    zero_init: bool = True  # adaLN-Zero: gates, timestep modulation and output head start at zero
    threads: int = 1

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "frames", "sprites", "threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not 0 < self.lr < 1 or not 0 <= self.ema < 1 or not 0 <= self.discrete_sigma_prob <= 1:
            raise ValueError(f"lr in (0, 1), ema in [0, 1), discrete_sigma_prob in [0, 1]; got {self.lr}, "
                             f"{self.ema}, {self.discrete_sigma_prob}")
        if not self.sprite_weight >= 1:
            raise ValueError(f"sprite_weight must be >= 1, got {self.sprite_weight}")
        if not 0 < self.sigma_min < 1:
            raise ValueError(f"sigma_min must be in (0, 1), got {self.sigma_min}")



@dataclass(frozen=True)
class EvalConfig:
    """What :func:`evaluate` runs (recorded with the result)."""

    clips: int = 6
    frames: int = 48
    capacities: tuple[int, ...] = (6, 8, 12)
    kinds: tuple[str, ...] | None = None  # None: streamkv_lab.kinds.compared_kinds() (``full`` is the reference)
    tau: float = 0.05
    oracle_taus: tuple[float, ...] = (0.05, 0.1, 0.2)
    horizon: int = 16  # the training window (frames)
    data_seed: int = 20251
    noise_seed: int = 0
    min_reentry_gap: int = 2
    min_revisit_gap: int = 4
    position_clips: int = 0  # clips streamed position_factor x the training window under every position map
    position_factor: int = 8

    def run_kinds(self) -> tuple[str, ...]:
        """The kinds compared (the default: :func:`~streamkv_lab.kinds.compared_kinds`)."""
        from streamkv_lab.kinds import check_kinds, compared_kinds

        return check_kinds(self.kinds, compared_kinds())

    def __post_init__(self) -> None:
        if self.clips < 1 or self.frames % 2 or self.frames <= CONTEXT_FRAMES:
            raise ValueError(f"clips >= 1 and an even frames > {CONTEXT_FRAMES} needed, got {self.clips}, {self.frames}")
        if self.position_clips < 0 or self.position_factor < 1:
            raise ValueError(f"position_clips >= 0 and position_factor >= 1 needed, got {self.position_clips}, "
                             f"{self.position_factor}")
        if not self.capacities or any(c < 4 or c % 2 for c in self.capacities):
            raise ValueError(f"capacities must be even frame counts >= 4, got {self.capacities}")
