"""``Dims``: where tokens, heads and features lie in a cache's tensors, and the views between
the layouts the library uses. Pure shape arithmetic; every store and every reader goes
through it, so none of them knows a layout by heart.

A layer's K (V) has ``k_shape`` (``v_shape``), tokens (slots) at ``seq``, features last, and
optionally a head dim ``head``. Three views of the same data::

    layer      k_shape                     e.g. [B, S, H, D]     (the user's layout)
    attention  the token dim moved next to the features: [..., S, D]  e.g. [B, H, S, D]
    rows       [S, H, *rest, D]            token-major, one (token, head) pair per index:
                                           what per-head writes and gathers index
    heads      [H, R, S, D]                R the product of the other leading dims

``head_axis`` is the head's index among the leading dims of the attention layout (None when
there is no head dim: one virtual head).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from ..validate import check_int

__all__ = ["Dims", "check_shape", "normalise_dims"]


def check_shape(name: str, shape: object) -> tuple[int, ...]:
    """A tuple of positive ints with at least a token and a feature dim."""
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"{name} must be a tuple of ints, got {type(shape).__name__} {shape!r}")
    out = tuple(check_int(f"{name}[{i}]", s) for i, s in enumerate(shape))
    if len(out) < 2:
        raise ValueError(f"{name} must have at least 2 dims (tokens and features), got {out}")
    if any(s < 1 for s in out):
        raise ValueError(f"{name} must have positive sizes, got {out}")
    return out


def normalise_dims(k_shape: tuple[int, ...], seq_dim: object, head_dim: object) -> tuple[int, int | None]:
    """``(seq, head)`` as non-negative indices of ``k_shape``; ``head`` None when the shape has
    no dimension besides tokens and features. The head dimension defaults to the last one
    that is neither the token nor the feature dimension."""
    rank = len(k_shape)
    seq_dim = check_int("seq_dim", seq_dim)
    if not -rank <= seq_dim < rank or seq_dim % rank == rank - 1:
        raise ValueError(
            f"seq_dim must index a non-feature dim of a rank-{rank} shape (in [{-rank}, {rank - 2}] and not "
            f"{rank - 1} or -1), got {seq_dim}"
        )
    seq = seq_dim % rank
    others = [d for d in range(rank - 1) if d != seq]
    if head_dim is None:
        return seq, (others[-1] if others else None)
    head_dim = check_int("head_dim", head_dim)
    if not -rank <= head_dim < rank or head_dim % rank not in others:
        raise ValueError(
            f"head_dim must index a dim of k_shape {k_shape} other than the token (seq_dim={seq}) and feature "
            f"({rank - 1}) dims, i.e. one of {others}, got {head_dim}"
        )
    return seq, head_dim % rank


@dataclass(frozen=True)
class Dims:
    """The dims of one cache's layers (see the module docstring). ``slots``: the token extent
    of the stored buffers; ``chunk``: the rows of a span at most."""

    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    seq: int
    head: int | None
    slots: int
    chunk: int

    @classmethod
    def of(cls, k_shape: Sequence[int], v_shape: Sequence[int], seq_dim: object, head_dim: object, *, slots: int,
           chunk: int) -> Dims:
        k_shape, v_shape = check_shape("k_shape", k_shape), check_shape("v_shape", v_shape)
        if len(k_shape) != len(v_shape) or k_shape[:-1] != v_shape[:-1]:
            raise ValueError(f"k_shape and v_shape must agree except in the last dim, got {k_shape} and {v_shape}")
        seq, head = normalise_dims(k_shape, seq_dim, head_dim)
        return cls(k_shape, v_shape, seq, head, slots, chunk)

    # ------------------------------------------------------------------ sizes
    @property
    def rank(self) -> int:
        return len(self.k_shape)

    @property
    def heads(self) -> int:
        return self.k_shape[self.head] if self.head is not None else 1

    @property
    def features(self) -> tuple[int, int]:
        """``(D, Dv)``: key and value feature sizes."""
        return self.k_shape[-1], self.v_shape[-1]

    def shape(self, which: str, tokens: int, last: int | None = None) -> tuple[int, ...]:
        """One layer's ``"k"`` / ``"v"`` shape with ``tokens`` at ``seq`` (and ``last`` features)."""
        s = self.k_shape if which == "k" else self.v_shape
        out = s[: self.seq] + (tokens,) + s[self.seq + 1 :]
        return out if last is None else out[:-1] + (last,)

    @property
    def rows_per_slot(self) -> int:
        """``R``: the product of the leading dims besides tokens and heads (e.g. the batch)."""
        n = 1
        for d, s in enumerate(self.k_shape[:-1]):
            if d not in (self.seq, self.head):
                n *= s
        return n

    # ------------------------------------------------------------------ views
    @property
    def head_axis(self) -> int | None:
        """The head dim's index among the leading dims of the attention layout (None: no head dim)."""
        if self.head is None:
            return None
        return [d for d in range(self.rank - 1) if d != self.seq].index(self.head)

    @property
    def rows_perm(self) -> tuple[int, ...]:
        """The permutation of a layer's dims to ``[T, H, *rest, D]`` (``[T, *rest, D]`` without a head)."""
        rest = [d for d in range(self.rank - 1) if d not in (self.seq, self.head)]
        return (self.seq, *([self.head] if self.head is not None else []), *rest, self.rank - 1)

    @property
    def rows_inverse(self) -> tuple[int, ...]:
        """The inverse of :attr:`rows_perm`."""
        inv = [0] * self.rank
        for i, p in enumerate(self.rows_perm):
            inv[p] = i
        return tuple(inv)

    def rows(self, x: Tensor) -> Tensor:
        """One layer's tensor (any token count) as ``[T, H, *rest, D]``: a view."""
        return x.permute(self.rows_perm)

    def unrows(self, x: Tensor) -> Tensor:
        """The inverse of :meth:`rows`: a view in the layer's layout."""
        return x.permute(self.rows_inverse)

    def attention(self, x: Tensor) -> Tensor:
        """One layer's tensor with the token dim moved next to the features (a view)."""
        return x.movedim(self.seq, -2)

    def from_attention(self, x: Tensor) -> Tensor:
        return x.movedim(-2, self.seq)

    def to_heads(self, x: Tensor) -> Tensor:
        """One layer's tensor (any token count; queries may have a multiple of the heads) as
        ``[H, R, T, D]`` (a view where the layout allows)."""
        rest = [d for d in range(self.rank - 1) if d not in (self.seq, self.head)]
        head = [self.head] if self.head is not None else []
        x = x.permute(*head, *rest, self.seq, self.rank - 1)
        if self.head is None:
            x = x.unsqueeze(0)
        return x.reshape(x.shape[0], -1, *x.shape[-2:])

    def lay_out_heads(self, t: Tensor) -> Tensor:
        """A per-head tensor ``[H, Q, S]`` (or ``[1, Q, S]``) shaped to broadcast against scores
        ``[..., Q, S]`` of a layer in the attention layout: ``H`` at :attr:`head_axis`."""
        shape = [1] * (self.rank - 2) + list(t.shape[-2:])
        if self.head_axis is None:
            return t[:1].view(shape)
        shape[self.head_axis] = t.shape[0]
        return t.view(shape)
