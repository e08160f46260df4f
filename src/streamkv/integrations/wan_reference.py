"""The reference a streamed diffusers Wan must equal: one forward of the same model over the
clean context and the chunk, with a block-causal mask, through diffusers' own code.

For a forward that the stream ran on chunk ``c`` (latents ``x``, timestep ``t``, prompt
``e``), the reference is::

    model(cat(x0_0, ..., x0_{c-1}, x), per-token timesteps [0 ... 0, t ... t], e)

with every ``attn1`` running diffusers' ``WanAttnProcessor`` given a boolean mask: a token
of chunk ``a`` sees the tokens the cache held while chunk ``a`` was open (the chunk itself
included). RoPE is diffusers' own over the whole sequence (frames from 0), so the stream's
absolute-offset tables are checked too. The context is at its clean timestep 0, as the
clean pass that wrote its K/V was; the per-token timesteps take diffusers' Wan 2.2 path of
the same forward. The chunk's rows of the output are compared.

Masks: :func:`window_visibility` states the sink + window retention of
:class:`~streamkv.layout.CacheLayout` (ring and chronological caches);
:func:`retained_visibility` builds per-head masks from the positions a cache reported
(scored caches, whose retained set is the policy's choice).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..storage import check_int
from .wan_attention import CachedWanSelfAttention

__all__ = ["window_visibility", "retained_visibility", "reference_forward", "reference_chunk", "recorded_masks",
           "MaskedWanAttention", "StreamedForward", "StreamRecorder"]


def window_visibility(num_tokens: int, *, chunk: int, sink: int, window: int, device=None) -> Tensor:
    """``bool [T, T]``: may query token ``i`` see key token ``j``.

    Token ``i`` of chunk ``a`` (``end = (a + 1) * chunk``) sees ``j`` iff ``j < end`` and
    (``j < sink`` or ``j >= end - window``): block-causal over chunks, and the retained set
    ``[0, sink) U [end - window, end)`` of a sink + window cache while chunk ``a`` is open.
    """
    num_tokens, chunk = check_int("num_tokens", num_tokens, 1), check_int("chunk", chunk, 1)
    sink, window = check_int("sink", sink, 0), check_int("window", window, 1)
    j = torch.arange(num_tokens, device=device)
    end = (j // chunk + 1) * chunk  # per query row
    end = end.view(-1, 1)
    return (j.view(1, -1) < end) & ((j.view(1, -1) < sink) | (j.view(1, -1) >= end - window))


def retained_visibility(retained: Sequence[Tensor], chunk: int, num_tokens: int) -> Tensor:
    """``bool [H, T, T]`` from the positions a cache held, per head, while each chunk was open.

    Args:
        retained: ``retained[a]`` is ``int64 [H, S]`` (``-1`` empty), the positions of one
            layer while chunk ``a`` was open (e.g. ``cache.layer_slot_positions(layer)``);
            one entry per chunk covering ``num_tokens``.
        chunk: tokens per chunk; ``num_tokens``: a multiple of it.
    """
    chunk, num_tokens = check_int("chunk", chunk, 1), check_int("num_tokens", num_tokens, 1)
    if num_tokens % chunk or len(retained) != num_tokens // chunk:
        raise ValueError(f"need one retained set per chunk: {num_tokens} tokens / {chunk} per chunk, got "
                         f"{len(retained)} sets")
    rows = []
    for a, held in enumerate(retained):
        if int(held.max()) >= num_tokens:
            raise ValueError(f"chunk {a}'s retained set holds position {int(held.max())} >= num_tokens={num_tokens}")
        seen = torch.zeros(held.shape[0], num_tokens + 1, dtype=torch.bool, device=held.device)
        seen.scatter_(1, torch.where(held >= 0, held, num_tokens), True)  # [H, T + 1]; column T: empty slots
        rows.append(seen[:, None, :num_tokens].expand(-1, chunk, -1))
    return torch.cat(rows, dim=1)


class MaskedWanAttention:
    """An ``attn1`` processor that runs ``inner`` (diffusers' ``WanAttnProcessor``) with a
    boolean ``mask`` (``True``: attend) broadcastable to ``[B, H, T, T]``; ``inner`` is
    called unchanged, only the mask is added."""

    def __init__(self, inner, mask: Tensor) -> None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 4:
            raise ValueError(f"mask must be a 4-D bool tensor, got {getattr(mask, 'dtype', type(mask).__name__)} "
                             f"{tuple(getattr(mask, 'shape', ()))}")
        self.inner, self.mask = inner, mask

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None, **kw):
        if attention_mask is not None or encoder_hidden_states is not None:
            raise ValueError("MaskedWanAttention is a self-attention processor with its own mask")
        return self.inner(attn, hidden_states, None, self.mask, rotary_emb, **kw)


@torch.no_grad()
def reference_forward(model, latents: Tensor, timesteps: Tensor, prompt_embeds: Tensor,
                      masks: Tensor | Sequence[Tensor]) -> Tensor:
    """One forward of diffusers' ``WanTransformer3DModel`` with per-token timesteps and a
    self-attention mask, every ``attn1`` run by a fresh diffusers ``WanAttnProcessor``.

    Args:
        model: the model, with no :class:`StreamingWan` attached.
        latents: ``[B, C, F, H, W]``, the whole sequence (context frames, then the chunk).
        timesteps: ``[B, T]``, one per token (``T`` = patched frames x rows x columns).
        prompt_embeds: ``[B, text_len, text_dim]``.
        masks: ``bool``, ``True`` = attend: one ``[T, T]`` / ``[H, T, T]`` for every layer, or
            a sequence of them, one per layer.

    Returns:
        The model output ``[B, out_channels, F, H, W]``. The model's processors are restored
        (the same objects) on return, also on error. Runs under ``torch.no_grad``.

    Raises:
        RuntimeError: a StreamingWan is attached to the model.
        ValueError: a wrong number of masks.
    """
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    saved = dict(model.attn_processors)
    if any(isinstance(p, CachedWanSelfAttention) for p in saved.values()):
        raise RuntimeError("reference_forward needs the model as diffusers built it: detach() the StreamingWan first")
    layers = len(model.blocks)
    per_layer = [masks] * layers if isinstance(masks, Tensor) else list(masks)
    if len(per_layer) != layers:
        raise ValueError(f"need one mask per layer ({layers}), got {len(per_layer)}")
    if any(not isinstance(m, Tensor) or m.dim() not in (2, 3) for m in per_layer):
        raise ValueError(f"masks must be [T, T] or [H, T, T] tensors, got {[getattr(m, 'shape', m) for m in per_layer]}")
    processors = dict(saved)
    for i, m in enumerate(per_layer):
        m4 = m.view(1, *m.shape) if m.dim() == 3 else m.view(1, 1, *m.shape)
        processors[f"blocks.{i}.attn1.processor"] = MaskedWanAttention(WanAttnProcessor(), m4)
    model.set_attn_processor(processors)
    try:
        return model(hidden_states=latents, timestep=timesteps, encoder_hidden_states=prompt_embeds,
                     return_dict=False)[0]
    finally:
        model.set_attn_processor(dict(saved))


@dataclass
class StreamedForward:
    """One forward a stream ran: its inputs, output, and each layer's retained positions
    (``int64 [H, S]``, read while it ran)."""

    branch: str
    chunk: int
    latents: Tensor
    timestep: Tensor
    prompt_embeds: Tensor
    output: Tensor
    retained: list[Tensor]


class StreamRecorder:
    """Records every :meth:`StreamingWan.forward` (a forward hook on the model, removed by
    :meth:`close` or on leaving a ``with`` block) into :attr:`records`. Copies of the inputs
    and outputs are kept (memory grows with the stream: a test and lab tool)."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.records: list[StreamedForward] = []
        self._handle = stream.model.register_forward_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs, output) -> None:
        cache = self.stream.state.cache
        if cache is None:
            return  # not a streamed forward
        branch = next(b for b in self.stream.caches.branches if self.stream.caches[b] is cache)
        self.records.append(StreamedForward(
            branch=branch, chunk=cache.open_chunk, latents=kwargs["hidden_states"].clone(),
            timestep=kwargs["timestep"].clone(), prompt_embeds=kwargs["encoder_hidden_states"].clone(),
            output=output[0].clone(), retained=[cache.layer_slot_positions(i).clone() for i in range(cache.num_layers)],
        ))

    def close(self) -> None:
        self._handle.remove()

    def __enter__(self) -> StreamRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reference_chunk(model, record: StreamedForward, clean: Sequence[Tensor], masks: Tensor | Sequence[Tensor]
                    ) -> Tensor:
    """The chunk's rows of :func:`reference_forward` for a recorded forward: the context is
    ``clean[:record.chunk]`` (each ``[B, C, frames_per_chunk, H, W]``, the clean latents the
    stream produced) at timestep 0, then ``record.latents`` at ``record.timestep``.

    Returns ``[B, out_channels, frames_per_chunk, H, W]``, comparable with ``record.output``.
    ``masks`` as in :func:`reference_forward` over the ``(record.chunk + 1) * chunk_tokens``
    tokens of the sequence."""
    if len(clean) < record.chunk:
        raise ValueError(f"chunk {record.chunk} needs {record.chunk} clean chunks of context, got {len(clean)}")
    p_t, p_h, p_w = model.config.patch_size
    b, _, frames, h, w = record.latents.shape
    chunk_tokens = frames // p_t * (h // p_h) * (w // p_w)
    latents = torch.cat([*clean[: record.chunk], record.latents], dim=2)
    steps = torch.cat([torch.zeros(b, record.chunk * chunk_tokens, device=latents.device),
                       record.timestep.view(b, 1).float().expand(b, chunk_tokens)], dim=1)
    return reference_forward(model, latents, steps, record.prompt_embeds, masks)[:, :, -frames:]


def recorded_masks(records: Sequence[StreamedForward], record: StreamedForward, chunk_tokens: int) -> list[Tensor]:
    """Per-layer ``bool [H, T, T]`` masks for ``record`` from what its branch's cache held:
    for each earlier chunk the positions recorded at its last forward (the clean pass), for
    the record's own chunk its own (:func:`retained_visibility`)."""
    last: dict[int, StreamedForward] = {}
    for r in records:
        if r.branch == record.branch and r.chunk < record.chunk:
            last[r.chunk] = r
    missing = [a for a in range(record.chunk) if a not in last]
    if missing:
        raise ValueError(f"no recorded forward of branch {record.branch!r} for chunks {missing}")
    sets = [last[a] for a in range(record.chunk)] + [record]
    tokens = (record.chunk + 1) * chunk_tokens
    return [retained_visibility([s.retained[i] for s in sets], chunk_tokens, tokens) for i in range(len(record.retained))]
