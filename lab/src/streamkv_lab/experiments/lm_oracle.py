"""The per-query oracle mass budget of the kvbudget seed, run inside a real model.

Every query of every layer attends to the *smallest* set of its full causal history whose
attention mass is ``>= 1 - tau`` (sinks and the query's own chunk protected): the set
:class:`streamkv.budget.oracles.PerQueryMass` defines. Nothing streaming can do this (it
needs the whole history and the query first); it is the yardstick for the streaming caches.

:func:`mass_keep` computes that set for many rows at once. It is the set of
``PerQueryMass.keep`` (order: protected first, then mass descending, then position ascending;
the smallest such prefix whose mass reaches ``1 - tau``; the mass summed in float64, see
:func:`mass_keep`), found with ``topk`` of growing width instead of a full sort of every row
(a real model's attention puts ``1 - tau`` of its mass on a few hundred of thousands of keys).
It takes a per-row protected mask, so rows of different chunks share one call.
``tests/test_lm_eval.py`` checks it against ``PerQueryMass.keep`` and a brute force.

:func:`oracle_attention` is registered in transformers' attention registry as
``"streamkv-oracle"`` (with a mask function that accepts no padding): the model reads its
full history from a ``DynamicCache`` and each layer's output is the softmax restricted to the
oracle's set (renormalised). The run's parameters and statistics travel in the forward's
kwargs (``model(..., streamkv_oracle=OracleRun(...))``): no model patching, no global state.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = ["ORACLE_ATTENTION", "KWARG", "OracleRun", "mass_keep", "oracle_attention", "register_oracle"]

#: the ``attn_implementation`` name of the oracle attention function
ORACLE_ATTENTION = "streamkv-oracle"
#: the forward kwarg carrying the :class:`OracleRun`
KWARG = "streamkv_oracle"


def _prefix(cand: Tensor, prot: Tensor, vals: Tensor, j: Tensor) -> Tensor:
    """``[r, N]`` bool: the protected entries and the first ``j`` candidates in (mass
    descending, column ascending) order. ``vals``: the candidates' largest values,
    descending; ``0 <= j <= `` the candidates per row."""
    v = vals.gather(1, (j - 1).clamp(min=0).unsqueeze(1))  # the j-th largest candidate value
    gt = cand > v
    eq = cand == v
    room = j - gt.sum(-1)  # how many of the ties at v to take
    take = gt | eq
    tied = ((eq.sum(-1) > room) & (j > 0)).nonzero().flatten()
    if tied.numel():  # more ties at v than room: the oldest (lowest column) first
        e = eq[tied]
        take[tied] = gt[tied] | (e & (e.cumsum(-1) <= room[tied].unsqueeze(1)))
    return prot | (take & (j > 0).unsqueeze(1))


def mass_keep(p: Tensor, protected: Tensor, tau: float, *, width: int = 256) -> Tensor:
    """The per-query oracle's kept set for each row.

    Args:
        p: ``[R, N]`` float, attention weights of each row over ``N`` keys whose column index
            is their position order (rows sum to 1; masked keys are 0). Not mutated.
        protected: ``[R, N]`` bool, kept regardless of mass (they count toward the mass).
        tau: dropped-mass budget in (0, 1).
        width: first ``topk`` width; rows that need more candidates are redone 4x wider.

    Returns:
        ``[R, N]`` bool: per row, the protected keys plus the fewest others, heaviest first
        (older first on equal mass), whose kept mass reaches ``1 - tau``; every key if no
        prefix reaches it. The mass is summed in float64 (the protected keys' sum, then the
        others in order): ``PerQueryMass`` sums ``(p * keep).sum(-1)`` in ``p``'s dtype, so
        the two can differ by one key when those two sums fall on either side of ``1 - tau``
        (a rounding-level tie; equal sets otherwise, checked on float64 rows in the tests).
    """
    if p.dim() != 2 or protected.shape != p.shape or protected.dtype != torch.bool:
        raise ValueError(f"p must be [R, N] and protected a bool mask of the same shape, got {tuple(p.shape)} and "
                         f"{tuple(protected.shape)} {protected.dtype}")
    if not 0.0 < tau < 1.0:
        raise ValueError(f"tau must be in (0, 1), got {tau}")
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    R, N = p.shape
    target = 1.0 - tau
    keep = protected.clone()
    base = (p * protected).sum(-1, dtype=torch.float64)  # the protected mass
    todo = (base < target).nonzero().flatten()
    n_cand = N - protected.sum(-1)
    k = width
    while todo.numel():
        k = min(k, N)
        prot = protected[todo]
        cand = p[todo].masked_fill(prot, -1.0)  # protected never compete; every candidate is >= 0
        vals = cand.topk(k, dim=-1).values  # descending
        seen = n_cand[todo].clamp(max=k)  # candidates among the k values
        reached = (base[todo].unsqueeze(1) + vals.double().clamp(min=0).cumsum(-1)) >= target
        reached &= torch.arange(k) < seen.unsqueeze(1)
        hit = reached.any(-1)
        j = torch.where(hit, reached.to(torch.int8).argmax(-1) + 1, seen)
        done = hit | (seen >= n_cand[todo])  # the target reached, or every candidate in view (keep all)
        keep[todo[done]] = _prefix(cand[done], prot[done], vals[done], j[done])
        todo = todo[~done]
        k *= 4
    return keep


class OracleRun:
    """Parameters and statistics of one oracle run (passed as ``streamkv_oracle=`` to each
    forward).

    Args:
        tau: the dropped-mass budget.
        sink: positions ``< sink`` are protected.
        chunk: each query's own chunk is protected: the visible part of
            ``[p - p % chunk, p]`` (``chunk=1``: the query itself); change it between
            forwards to model a decode tail after a chunked prefill.
        num_layers: of the model.
        error_stride: the attention error against full-history attention is recorded for
            queries at positions ``p`` with ``(p + 1) % error_stride == 0``.

    Statistics (host floats, accumulated over every forward until :meth:`summary`): kept
    keys per (query, head) row, their mean and the distribution's p99; per layer, the
    relative L2 error ``||o_oracle - o_full|| / ||o_full||`` of the sampled rows.
    """

    def __init__(self, tau: float, sink: int, chunk: int, num_layers: int, error_stride: int = 8) -> None:
        self.tau, self.sink, self.chunk, self.error_stride = tau, sink, chunk, error_stride
        self.kept: list[Tensor] = []  # per call: kept counts (int32)
        self.errors: list[list[Tensor]] = [[] for _ in range(num_layers)]

    def protected(self, q_pos: Tensor, n_keys: int) -> Tensor:
        """``[n, N]`` bool: sinks and the visible part of each query's own chunk."""
        cols = torch.arange(n_keys).unsqueeze(0)
        q = q_pos.unsqueeze(1)
        start = q - q % self.chunk
        return (cols < self.sink) | ((cols >= start) & (cols <= q))

    def summary(self) -> dict[str, Any]:
        kept = torch.cat(self.kept).double() if self.kept else torch.zeros(1, dtype=torch.float64)
        layers = [_error_stats(e) for e in self.errors]
        every = _error_stats([t for e in self.errors for t in e])
        return {"memory_tokens": float(kept.mean()), "memory_p99": float(kept.quantile(0.99)) if kept.numel() < 2**24
                else float(kept.max()), "memory_max": float(kept.max()), "attn_error_mean": every["mean"],
                "attn_error_p99": every["p99"], "attn_error_layers": layers}


def _error_stats(parts: list[Tensor]) -> dict[str, float | None]:
    if not parts:
        return {"mean": None, "p99": None}
    e = torch.cat(parts).double()
    return {"mean": float(e.mean()), "p99": float(torch.quantile(e, 0.99)) if e.numel() < 2**24 else float(e.max())}


def oracle_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function interface: the oracle's restricted softmax.

    ``query`` ``[1, H_q, n, D]`` at positions ``E - n .. E - 1``; ``key``/``value``
    ``[1, H_kv, E, D]``: the full history in position order (a ``DynamicCache``). Computes
    the causal attention ``p`` in float32, the oracle's set (:func:`mass_keep`), and returns
    ``softmax restricted to the set`` @ V as ``[1, n, H_q, D]`` in the query's dtype. Records
    the kept counts and sampled errors in the :class:`OracleRun` (``kwargs["streamkv_oracle"]``).
    """
    run = kwargs.get(KWARG)
    if not isinstance(run, OracleRun):
        raise RuntimeError(f"attn_implementation={ORACLE_ATTENTION!r} needs model(..., {KWARG}=OracleRun(...))")
    if attention_mask is not None or dropout:
        raise ValueError("the oracle attention takes no mask (no padding) and no dropout")
    B, Hq, n, D = query.shape
    _, Hkv, E, _ = key.shape
    if B != 1:
        raise ValueError(f"the oracle attention runs batch 1, got {B}")
    q_pos = torch.arange(E - n, E)
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and not torch.equal(position_ids.reshape(-1).cpu(), q_pos):
        raise ValueError(f"the oracle needs the history in position order: queries at {E - n}..{E - 1}, got "
                         f"position_ids {position_ids.reshape(-1)[:4].tolist()}...")
    G = Hq // Hkv
    scale = scaling if scaling is not None else 1.0 / math.sqrt(D)
    q = query[0].float().reshape(Hkv, G * n, D)
    k, v = key[0].float(), value[0].float()
    scores = (q @ k.transpose(-1, -2) * scale).view(Hq, n, E)
    visible = torch.arange(E).unsqueeze(0) <= q_pos.unsqueeze(1)  # [n, E]
    p = scores.masked_fill(~visible, -math.inf).softmax(-1)
    prot = run.protected(q_pos, E).expand(Hq, n, E).reshape(Hq * n, E)
    keep = mass_keep(p.reshape(Hq * n, E), prot, run.tau).view(Hq, n, E)
    run.kept.append((keep & visible).sum(-1).flatten().to(torch.int32))
    pk = p * keep
    out = (pk.view(Hkv, G * n, E) @ v).view(Hq, n, D) / pk.sum(-1, keepdim=True)
    sel = ((q_pos + 1) % run.error_stride == 0).nonzero().flatten()
    if sel.numel():
        full = (p[:, sel].reshape(Hkv, G * sel.numel(), E) @ v).view(Hq, sel.numel(), D)
        err = (out[:, sel] - full).norm(dim=-1) / full.norm(dim=-1).clamp_min(1e-30)
        run.errors[module.layer_idx].append(err.flatten())
    return out.transpose(0, 1).unsqueeze(0).to(query.dtype), None


def oracle_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                mask_function: Any = None, attention_mask: Tensor | None = None, **kwargs: Any) -> None:
    """The mask function of ``"streamkv-oracle"``: no padding accepted; the attention
    function builds the causal mask itself."""
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("the oracle attention refuses padding (attention_mask with zeros)")


def register_oracle() -> None:
    """Register ``"streamkv-oracle"`` in transformers' attention and mask registries (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ORACLE_ATTENTION, oracle_attention)
    AttentionMaskInterface.register(ORACLE_ATTENTION, oracle_mask)
