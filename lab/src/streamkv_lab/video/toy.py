"""The trained toy model: its constants, weights on disk, and a conditioned stream.

- ``toy`` config (:data:`streamkv.models.config.CONFIGS`): 16x16 RGB frames as latents.
- :data:`SCHEDULE`: the sampler it is trained for (4 flow-matching steps, no shift).
- :data:`CONTEXT_FRAMES`: streams are conditioned on the ground truth's first frames
  (committed with :meth:`~streamkv.rollout.StreamingRollout.prefill_chunk`); the rest is
  generated, so generated frames can be compared with the analytic ground truth.
- :func:`load_model` / :func:`save_model`: ``safetensors`` weights with a JSON header. The
  committed weights (4.9 MB) stay in the source tree and out of the wheel (``pyproject.toml``
  package-data): the library carries none; the lab reads them from a clone.
- :func:`stream`: prefill + generate through any cache (kind or prebuilt
  :class:`~streamkv.caches.CacheSet`), with the same noise for every cache.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from streamkv.caches import CacheSet
from streamkv.models import CausalVideoDiT, get_config
from streamkv.models.config import DiTConfig
from streamkv.rollout import Schedule, StreamingRollout

from .config import CONTEXT_FRAMES

__all__ = ["CONFIG", "PROMPT", "SCHEDULE", "CONTEXT_FRAMES", "WEIGHTS", "METADATA", "EXPECTED", "toy_config",
           "load_model", "save_model", "geometry_model", "stream", "check_rollout", "training_horizon"]

CONFIG = "toy"
PROMPT = "sprites bouncing in a panning world"
SCHEDULE = Schedule(timesteps=(1000.0, 750.0, 500.0, 250.0), shift=1.0)
WEIGHTS = Path(__file__).resolve().parent / "weights" / "toy.safetensors"
METADATA = WEIGHTS.with_name("toy.json")
EXPECTED = WEIGHTS.with_name("toy_expected.safetensors")
#: the check rollout: held-out clip (CHECK_SEED, 0), CHECK_FRAMES frames, ring, noise seed 0
CHECK_SEED = 99_001
CHECK_FRAMES = 12


def toy_config(*, sink_frames: int | None = None, window_frames: int | None = None) -> DiTConfig:
    """The ``toy`` config, with another cache geometry if asked (the weights do not depend on it)."""
    cfg = get_config(CONFIG)
    changes = {k: v for k, v in (("sink_frames", sink_frames), ("window_frames", window_frames)) if v is not None}
    return dataclasses.replace(cfg, **changes) if changes else cfg


def save_model(model: CausalVideoDiT, path: str | Path, metadata: dict[str, Any]) -> Path:
    """Write the weights (float32 safetensors; ``metadata`` as a JSON string under "streamkv")."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(path), metadata={"streamkv": json.dumps(metadata, sort_keys=True)})
    return path


def load_model(path: str | Path = WEIGHTS, *, sink_frames: int | None = None,
               window_frames: int | None = None) -> CausalVideoDiT:
    """The toy DiT with the weights at ``path`` (eval mode, CPU float32); ``sink_frames`` /
    ``window_frames`` choose another cache geometry for the same weights.

    Raises:
        FileNotFoundError: no weights at ``path`` (``streamkv train-toy`` writes them).
        RuntimeError: the file's tensors do not match the ``toy`` config.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no toy weights at {path}: they live in the source repository (lab/src/streamkv_lab/video/weights/, "
            f"not in the wheel); run from a clone (make demo), pass the path, or `streamkv train-toy` to produce them"
        )
    model = CausalVideoDiT(toy_config(sink_frames=sink_frames, window_frames=window_frames))
    model.load_state_dict(load_file(str(path)), strict=True)
    return model.eval()


def geometry_model(model: CausalVideoDiT, *, sink_frames: int, window_frames: int) -> CausalVideoDiT:
    """The same weights under another cache geometry (a new module; ``model`` is unchanged)."""
    cfg = dataclasses.replace(model.cfg, sink_frames=sink_frames, window_frames=window_frames)
    if cfg == model.cfg:
        return model
    other = CausalVideoDiT(cfg)
    other.load_state_dict(model.state_dict())
    return other.eval()


@torch.no_grad()
def stream(model: CausalVideoDiT, context: Tensor, total_frames: int, *, cache: str | CacheSet = "ring",
           seed: int = 0, cache_kwargs: dict[str, Any] | None = None) -> Tensor:
    """Stream ``total_frames`` frames: the ``context`` chunks committed as given, the rest
    generated with :data:`SCHEDULE` and the noise of ``seed`` (the same for every cache).

    Args:
        model: the toy DiT (its config fixes the cache geometry unless ``cache`` is a set).
        context: latents ``[B, 3, F0, 16, 16]`` with ``F0`` a multiple of the chunk.
        total_frames: frames of the stream (a multiple of the chunk, ``>= F0``).
        cache: a kind or a prebuilt one-branch cache set (observers attached stay attached).

    Returns:
        latents ``[B, 3, total_frames, 16, 16]`` (context included).
    """
    fpc = model.cfg.frames_per_chunk
    f0 = context.shape[2]
    if f0 % fpc or total_frames % fpc or total_frames < f0:
        raise ValueError(f"context ({f0}) and total_frames ({total_frames}) must be multiples of the chunk ({fpc}) "
                         f"with total_frames >= context frames")
    roll = StreamingRollout(model, cache=cache, batch=context.shape[0], schedule=SCHEDULE, seed=seed,
                            cache_kwargs=cache_kwargs)
    roll.set_prompt(PROMPT, seed=seed)
    out = [roll.prefill_chunk(context[:, :, i : i + fpc]) for i in range(0, f0, fpc)]
    out += [roll.generate_chunk() for _ in range((total_frames - f0) // fpc)]
    return torch.cat(out, dim=2)


def training_horizon(path: str | Path = WEIGHTS) -> int:
    """The training window (frames) recorded in the weights' header by ``streamkv train-toy``."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get("streamkv", "{}"))
    if "frames" not in meta:
        raise ValueError(f"{path} does not record its training window (no 'frames' in its streamkv header)")
    return int(meta["frames"])


def check_rollout(model: CausalVideoDiT) -> Tensor:
    """The stored-expectation rollout: clip ``(CHECK_SEED, 0)``, its first
    :data:`CONTEXT_FRAMES` frames committed, the rest to :data:`CHECK_FRAMES` generated
    with the model's own (ring) cache and noise seed 0. Returns latents ``[1, 3, T, 16, 16]``."""
    from .data import make_clip, to_latents

    rgb = make_clip(CHECK_SEED, 0, CHECK_FRAMES)[2]
    ctx = to_latents(rgb)[None][:, :, :CONTEXT_FRAMES]
    return stream(model, ctx, CHECK_FRAMES, cache="ring", seed=0)
