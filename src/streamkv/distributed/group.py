"""The context-parallel group and the Ulysses exchanges (head-sharded attention).

``N`` ranks share one chunk of ``L`` tokens. Outside attention every rank holds a
contiguous shard of the chunk's tokens, all heads; inside attention every rank holds
the whole chunk, ``H / N`` heads (rank ``r`` owns heads ``[r H/N, (r+1) H/N)``)::

    tokens -> heads  [B, L/N, H, D] --all-to-all--> [B, L, H/N, D]
                     (q, k, v of a block in one exchange)
    cache            each rank writes its H/N heads of the chunk and keeps them for the
                     whole window: history never moves between ranks, only the chunk
    attention        local: softmax is per head, so a head's output needs nothing else
    heads -> tokens  [B, L, H/N, D] --all-to-all--> [B, L/N, H, D]

Rank ``r`` sends block ``j`` (its tokens, rank ``j``'s heads) to rank ``j`` and
receives block ``j`` (rank ``j``'s tokens, its own heads) from it, so the received
blocks laid end to end are the chunk's tokens in order.

Backends: ``all_to_all_single`` on NCCL (CUDA) and on gloo (CPU). Gloo has had
``alltoall`` on CPU tensors for years; the exchange is therefore the same call on
both, no all-gather emulation. :meth:`ContextParallel.gather_tokens` (the model's
output, once per forward) uses the list form of ``all_gather``, which every backend
has.

Inference only: the c10d collectives used here are not differentiable. Eager calls
issue them directly; ``torch.compile(fullgraph=True)`` traces them (as functional
collectives; tested on gloo). CUDA-graph capture of them is refused with more than
one rank, see :class:`~streamkv.rollout.StreamingRollout`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from ..validate import check_int

__all__ = ["ContextParallel", "check_split"]


def check_split(*, heads: int, chunk_tokens: int, world_size: int, what: str = "") -> None:
    """Raise ``ValueError`` unless ``heads`` and the chunk's tokens split evenly over
    ``world_size`` ranks (Ulysses shards heads inside attention and tokens outside).

    ``what`` (e.g. ``"config 'tiny'"``) is named in the message.
    """
    world_size = check_int("world_size", world_size, 1)
    where = f" ({what})" if what else ""
    if heads % world_size:
        raise ValueError(
            f"context parallelism shards attention heads over the ranks: heads ({heads}) must be divisible "
            f"by the world size ({world_size}){where}"
        )
    if chunk_tokens % world_size:
        raise ValueError(
            f"context parallelism shards the chunk's tokens over the ranks: chunk tokens ({chunk_tokens}) must be "
            f"divisible by the world size ({world_size}){where}"
        )


@dataclass(frozen=True)
class ContextParallel:
    """A context-parallel (Ulysses) group: this rank's index, the group size and the
    process group the exchanges run on.

    Args:
        world_size: ranks in the group (``N``).
        rank: this rank's index in the group, ``0 <= rank < world_size``.
        group: the ``torch.distributed`` process group; ``None`` means the default
            group. Not used when ``world_size == 1`` (every exchange is the identity).

    Build it from an initialised process group with :meth:`from_group`. Constructing
    one by hand (without ``torch.distributed``) is enough for the shape checks
    (``StreamingRollout`` validates before anything runs); the exchanges need the group.
    """

    world_size: int
    rank: int
    group: Any = None

    def __post_init__(self) -> None:
        for name in ("world_size", "rank"):
            value = getattr(self, name)
            check_int(name, value)
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")

    @classmethod
    def from_group(cls, group: Any = None) -> ContextParallel:
        """The group of an initialised ``torch.distributed`` (``group=None``: the default
        group). Raises ``RuntimeError`` if ``torch.distributed`` is not initialised."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ContextParallel.from_group needs an initialised torch.distributed process group "
                "(torch.distributed.init_process_group, or streamkv.distributed.launch)"
            )
        return cls(dist.get_world_size(group), dist.get_rank(group), group)

    # ---------------------------------------------------------------- shapes
    def check_split(self, *, heads: int, chunk_tokens: int, what: str = "") -> None:
        """:func:`check_split` for this group's size."""
        check_split(heads=heads, chunk_tokens=chunk_tokens, world_size=self.world_size, what=what)

    def head_range(self, heads: int) -> tuple[int, int]:
        """``[start, stop)`` of the heads this rank owns inside attention."""
        if heads % self.world_size:
            raise ValueError(f"heads ({heads}) must be divisible by the world size ({self.world_size})")
        per = heads // self.world_size
        return self.rank * per, (self.rank + 1) * per

    def shard_heads(self, x: Tensor, dim: int = -2) -> Tensor:
        """This rank's heads of ``x`` along ``dim`` (e.g. text K/V ``[B, T, H, D]`` ->
        ``[B, T, H/N, D]``), as a contiguous copy so the full tensor can be freed."""
        start, stop = self.head_range(x.shape[dim])
        return x.narrow(dim, start, stop - start).contiguous()

    def shard_tokens(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's contiguous token shard of ``x`` along ``dim``: ``[B, L, F]`` ->
        ``[B, L/N, F]`` (a view)."""
        n = x.shape[dim]
        if n % self.world_size:
            raise ValueError(f"tokens ({n}) must be divisible by the world size ({self.world_size})")
        per = n // self.world_size
        return x.narrow(dim, self.rank * per, per)

    # ------------------------------------------------------------- exchanges
    def tokens_to_heads(self, *xs: Tensor) -> tuple[Tensor, ...]:
        """Token shards, all heads -> the whole chunk, this rank's heads; one all-to-all
        for all of ``xs``.

        Args:
            xs: ``[B, L/N, H, D_i]`` each (same ``B``, ``L/N``, ``H``; ``D_i`` may differ).

        Returns:
            ``[B, L, H/N, D_i]`` each, contiguous, tokens in chunk order.
        """
        if not xs:
            raise ValueError("tokens_to_heads needs at least one tensor")
        b, l, h = _common_dims("tokens_to_heads", xs)
        n = self.world_size
        if h % n:
            raise ValueError(f"tokens_to_heads: heads ({h}) must be divisible by the world size ({n})")
        if n == 1:
            return tuple(xs)
        dims = [x.shape[-1] for x in xs]
        # send[j] = my tokens, rank j's heads; the D of every input side by side
        send = xs[0].new_empty((n, b, l, h // n, sum(dims)))
        for x, part in zip(xs, send.split(dims, dim=-1)):
            part.copy_(x.unflatten(2, (n, h // n)).permute(2, 0, 1, 3, 4))
        recv = self._all_to_all(send)  # recv[j] = rank j's tokens, my heads
        return tuple(
            part.permute(1, 0, 2, 3, 4).reshape(b, n * l, h // n, d)
            for part, d in zip(recv.split(dims, dim=-1), dims)
        )

    def heads_to_tokens(self, x: Tensor) -> Tensor:
        """The whole chunk, this rank's heads -> this rank's token shard, all heads (the
        inverse of :meth:`tokens_to_heads`).

        Args:
            x: ``[B, L, H/N, D]``.

        Returns:
            ``[B, L/N, H, D]``, contiguous.
        """
        if x.dim() != 4:
            raise ValueError(f"heads_to_tokens expects [B, L, H/N, D], got shape {tuple(x.shape)}")
        b, seq, hl, d = x.shape
        n = self.world_size
        if seq % n:
            raise ValueError(f"heads_to_tokens: tokens ({seq}) must be divisible by the world size ({n})")
        if n == 1:
            return x
        # send[j] = rank j's tokens, my heads
        send = x.unflatten(1, (n, seq // n)).permute(1, 0, 2, 3, 4).contiguous()
        recv = self._all_to_all(send)  # recv[j] = my tokens, rank j's heads
        return recv.permute(1, 2, 0, 3, 4).reshape(b, seq // n, n * hl, d)

    def gather_tokens(self, x: Tensor, dim: int = 1) -> Tensor:
        """Every rank's token shard laid end to end along ``dim``: ``[B, L/N, F]`` ->
        ``[B, L, F]``, the same on every rank (the inverse of :meth:`shard_tokens`)."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def _all_to_all(self, send: Tensor) -> Tensor:
        import torch.distributed as dist

        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv

    def __repr__(self) -> str:
        return f"ContextParallel(rank={self.rank}, world_size={self.world_size})"


def _common_dims(name: str, xs: Sequence[Tensor]) -> tuple[int, int, int]:
    for x in xs:
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} expects tensors, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} expects [B, L/N, H, D] tensors, got shape {tuple(x.shape)}")
    b, l, h = xs[0].shape[:3]
    for x in xs[1:]:
        if tuple(x.shape[:3]) != (b, l, h):
            raise ValueError(
                f"{name}: every tensor must share [B, L/N, H] = {[b, l, h]}, got {list(x.shape[:3])}"
            )
    return b, l, h
