"""Training the toy DiT on procedural clips: teacher forcing with per-chunk noise levels and
flow matching, block-causal, on the CPU.

Recipe (the teacher-forcing objective of CausVid / Self-Forcing, with Diffusion Forcing's
independent per-chunk noise levels). A clip of ``T`` frames (``T / 2`` chunks) becomes one
sequence of ``2 T`` frames for :meth:`~streamkv.models.CausalVideoDiT.forward_sequence`::

    [ clean chunk 0 .. clean chunk n-1 | noised chunk 0 .. noised chunk n-1 ]
      t = 0                              t_c = 1000 sigma_c, sigma_c drawn per (clip, chunk)

with a frame-level mask: a clean chunk sees the clean chunks up to itself; a noised chunk
``c`` sees the clean chunks before ``c`` and itself. A noised chunk therefore sees exactly
what it sees in a full-history streaming rollout (the earlier chunks' clean-pass K/V and
its own), and the clean stream computes those clean-pass K/V. Noised copies share the clean
copies' stream frames (RoPE positions). Flow matching: ``x_sigma = (1 - sigma) x0 + sigma
eps``, the model predicts ``eps - x0``; the loss is its mean squared error over the noised
chunks (``sprite_weight > 1`` weighs the pixels a sprite covers that many times, normalised by
the mean weight; the committed weights use 1, plain MSE: with 8 the model draws sprites but
smears them into stacks when it runs free, see the README). ``sigma`` is one of the sampler's sigmas with probability ``discrete_sigma_prob``,
else uniform in ``[sigma_min, 1]``. The weights start from the model's seeded
initialisation with adaLN-Zero applied (:func:`zero_init_`); AdamW, linear warm-up then
cosine decay, gradient clipping, an EMA of the weights (what is saved). No self-forcing
stage: rolling the model out under gradients does not fit the CPU budget.

Everything is drawn from ``seed``: the initial weights (``CausalVideoDiT(seed=...)``), the
clips (stream ``seed`` of :func:`~streamkv_lab.video.data.make_clip`, clip ``step * batch +
i``) and the noise (a ``torch.Generator``). Same seed, same thread count, same torch: the
same weights bit for bit.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

from streamkv_lab.video.config import TrainConfig
from streamkv_lab.video.data import make_batch
from streamkv_lab.video.toy import PROMPT, SCHEDULE, toy_config
from streamkv.models import CausalVideoDiT

__all__ = ["TrainConfig", "TrainResult", "teacher_forcing_mask", "noised_batch", "zero_init_", "train"]


@dataclass
class TrainResult:
    model: CausalVideoDiT  # the EMA weights, eval mode
    losses: list[float]
    wall_s: float
    config: TrainConfig
    extra: dict = field(default_factory=dict)

    def record(self, every: int = 10) -> dict:
        """JSON record: the config, the loss curve (means over ``every`` steps), wall time."""
        curve = [sum(self.losses[i : i + every]) / len(self.losses[i : i + every])
                 for i in range(0, len(self.losses), every)]
        tail = self.losses[-max(1, len(self.losses) // 20):]
        return {
            "train_config": asdict(self.config), "wall_s": self.wall_s, "steps": len(self.losses),
            "loss_curve_every": every, "loss_curve": curve, "loss_first": self.losses[0],
            "loss_final_mean_last_5pct": sum(tail) / len(tail), **self.extra,
        }


def teacher_forcing_mask(frames: int, frames_per_chunk: int) -> tuple[Tensor, Tensor]:
    """``(frame_index int64 [2T], allowed bool [2T, 2T])`` of the teacher-forcing sequence
    ``[clean | noised]`` (see the module docstring)."""
    if frames % frames_per_chunk:
        raise ValueError(f"frames ({frames}) must be a multiple of the chunk ({frames_per_chunk})")
    idx = torch.arange(frames)
    chunk = idx // frames_per_chunk
    cq, ck = chunk.view(-1, 1), chunk.view(1, -1)
    allowed = torch.zeros(2 * frames, 2 * frames, dtype=torch.bool)
    allowed[:frames, :frames] = ck <= cq  # clean: block-causal
    allowed[frames:, :frames] = ck < cq  # noised chunk c: the clean chunks before c
    allowed[frames:, frames:] = ck == cq  # ... and itself
    return torch.cat([idx, idx]), allowed


def noised_batch(x0: Tensor, frames_per_chunk: int, gen: torch.Generator, cfg: TrainConfig) -> tuple[Tensor, Tensor, Tensor]:
    """``(x [B, C, 2T, H, W], t [B, 2T], target [B, C, T, H, W])`` for clean clips ``x0``."""
    b, _, f = x0.shape[:3]
    n = f // frames_per_chunk
    uniform = cfg.sigma_min + (1 - cfg.sigma_min) * torch.rand(b, n, generator=gen)
    discrete = torch.tensor(SCHEDULE.sigmas(), dtype=torch.float32)
    pick = discrete[torch.randint(len(discrete), (b, n), generator=gen)]
    use_discrete = torch.rand(b, n, generator=gen) < cfg.discrete_sigma_prob
    sigma = torch.where(use_discrete, pick, uniform).repeat_interleave(frames_per_chunk, 1)  # [B, T]
    eps = torch.randn(x0.shape, generator=gen)
    s = sigma.view(b, 1, f, 1, 1)
    xt = (1 - s) * x0 + s * eps
    t = torch.cat([torch.zeros(b, f), 1000.0 * sigma], dim=1)
    return torch.cat([x0, xt], dim=2), t, eps - x0


def zero_init_(model: CausalVideoDiT) -> None:
    """adaLN-Zero (DiT, Peebles & Xie 2023): zero the output head, the timestep modulation's
    last projection and every block's gates, so that each block starts as the identity and
    the initial flow prediction is zero. In place."""
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.zero_()
        model.time_proj[-1].weight.zero_()
        model.time_proj[-1].bias.zero_()
        for blk in model.blocks:
            blk.modulation[:, 2].zero_()  # gate of self-attention
            blk.modulation[:, 5].zero_()  # gate of the FFN


def _lr(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    p = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def train(cfg: TrainConfig, progress: Callable[[int, float], None] | None = None) -> TrainResult:
    """Train the ``toy`` DiT (see the module docstring); ``progress(step, loss)`` after each
    step. Sets ``torch.set_num_threads(cfg.threads)`` for the run and restores it."""
    before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg, progress)
    finally:
        torch.set_num_threads(before)


def _train(cfg: TrainConfig, progress: Callable[[int, float], None] | None) -> TrainResult:
    mcfg = toy_config()
    fpc = mcfg.frames_per_chunk
    model = CausalVideoDiT(mcfg, seed=cfg.seed).train()
    if cfg.zero_init:
        zero_init_(model)
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    frame_index, allowed = teacher_forcing_mask(cfg.frames, fpc)
    text = model.encode_prompt(PROMPT, cfg.batch)
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        x0, sprites = make_batch(cfg.seed, range(step * cfg.batch, (step + 1) * cfg.batch), cfg.frames, cfg.sprites)
        x, t, target = noised_batch(x0, fpc, gen, cfg)
        for group in opt.param_groups:
            group["lr"] = _lr(cfg, step)
        flow = model.forward_sequence(x, t, text, frame_index, allowed)[:, :, cfg.frames:]
        weight = 1.0 + (cfg.sprite_weight - 1.0) * sprites.float()  # [B, 1, T, H, W]
        loss = ((flow - target).pow(2) * weight).mean() / weight.mean()
        if not torch.isfinite(loss):
            raise RuntimeError(f"training diverged at step {step}: loss {loss.item()}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        decay = min(cfg.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for pe, p in zip(ema.parameters(), model.parameters()):
                pe.lerp_(p, 1 - decay)
        losses.append(loss.item())
        if progress is not None:
            progress(step, losses[-1])
    return TrainResult(model=ema, losses=losses, wall_s=time.perf_counter() - t0, config=cfg)
