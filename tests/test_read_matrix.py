"""Every read path is exact or refused: the whole matrix.

For every cache kind x stream state x attention path (auto, physical, chronological) x
occupancy (the cache's own, ``all``, ``prefix``, ``mask``) x mask (none, a chronological
``attn_mask``, ``causal``) x RoPE mode (absolute, cache-relative), ``attend`` either returns the
float64 softmax attention over exactly the tokens the cache holds (per head, from an independent
whole-history record; the mask and the RoPE applied in position order), or raises
``ValueError`` saying why. Never a third outcome.
"""

import itertools

import pytest
import torch

from streamkv import KVCache
from streamkv.attention import attend
from kinds import KINDS, params
from streamkv.certify import Certifier

S, W, C, H, D, B = 2, 7, 3, 2, 4, 1
KINDS = KINDS + ["ring+recall", "mass+recall"]
ORDERS = ["auto", "physical", "chronological"]
OCCUPANCIES = [None, "all", "prefix", "mask"]
MASKS = ["none", "attn_mask", "causal"]
ROPES = ["absolute", "cache_relative"]


def _stream(kind, chunks):
    """A cache of ``kind`` after ``chunks`` chunks (the last one open and written), with the
    whole history of what was written, per layer position."""
    policy, _, recall = kind.partition("+")
    cache = KVCache((B, S + W, H, D), (B, S + W, H, D + 1), policy=policy, seq_dim=1, sink=S, window=W, chunk=C,
                    dtype=torch.float64, recall_slots=6 if recall else 0, **params(policy))
    if recall:
        Certifier(cache, recall_tau=0.05)
    gen = torch.Generator().manual_seed(3)
    hist_k, hist_v = {}, {}
    for c in range(chunks):
        cache.begin_chunk(c)
        k = torch.randn(B, C, H, D, generator=gen, dtype=torch.float64) * 2
        v = torch.randn(B, C, H, D + 1, generator=gen, dtype=torch.float64)
        q = torch.randn(B, C, H, D, generator=gen, dtype=torch.float64) * 2
        attend(q, cache.update(k, v, q))
        for i in range(C):
            hist_k[c * C + i], hist_v[c * C + i] = k[:, i], v[:, i]
        if c + 1 < chunks:
            cache.commit_chunk(c)
    return cache, hist_k, hist_v


def _rotate(k):
    """A cache-relative 'RoPE' stand-in: rotate channel pairs by the key's chronological index."""
    n = k.shape[-2]
    ang = torch.arange(n, dtype=k.dtype).view(-1, 1) * torch.tensor([0.3, 0.7], dtype=k.dtype)
    cos, sin = ang.cos(), ang.sin()
    a, b = k[..., 0::2], k[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)


def _expected(cache, hist_k, hist_v, q, mask, rope, attn_mask):
    """Float64 attention over the held tokens of each head, in position order."""
    qpos = torch.arange(*[cache.open_span[0], cache.end])
    outs = []
    for h in range(H):
        pos = sorted(p for p in cache.layer_slot_positions(0)[h].tolist() if p >= 0)
        k = torch.stack([hist_k[p][:, h] for p in pos], 1)  # [B, n, D]
        v = torch.stack([hist_v[p][:, h] for p in pos], 1)
        if rope == "cache_relative":
            k = _rotate(k)
        s = q[:, :, h] @ k.transpose(-1, -2) / D**0.5  # [B, C, n]
        if mask == "causal":
            s = s.masked_fill(torch.tensor(pos).view(1, -1) > qpos.view(-1, 1), float("-inf"))
        if mask == "attn_mask":
            s = s.masked_fill(~attn_mask, float("-inf"))
        outs.append(s.softmax(-1) @ v)
    return torch.stack(outs, 2)  # [B, C, H, D + 1]


STATES = {"filling": 2, "full": 3, "wrapped": 9}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("state", list(STATES))
def test_every_read_path_is_exact_or_refused(kind, state):
    cache, hist_k, hist_v = _stream(kind, STATES[state])
    q = torch.randn(B, C, H, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    n_chrono = None if cache.chronological_refusal else cache.num_valid
    exact = refused = 0
    for order, occ, mask, rope in itertools.product(ORDERS, OCCUPANCIES, MASKS, ROPES):
        attn_mask = None
        if mask == "attn_mask":  # over the chronological keys; hides the oldest non-sink key
            n = n_chrono if n_chrono is not None else S + W
            attn_mask = torch.ones(C, n, dtype=torch.bool)
            attn_mask[:, min(S, n - 1)] = False
        kwargs = dict(order=order, rope_mode=rope, attn_mask=attn_mask, causal=mask == "causal")
        if rope == "cache_relative":
            kwargs["key_transform"] = _rotate
        what = f"{kind}/{state}: order={order} occupancy={occ} mask={mask} rope={rope}"
        try:
            out, info = attend(q, cache.read(occupancy=occ), **kwargs)
        except ValueError as exc:
            assert str(exc), what
            refused += 1
            # the refusals the design promises, and no others
            assert _must_refuse(cache, order, occ, mask, rope) or _may_refuse(cache, occ), f"{what}: {exc}"
            continue
        assert not _must_refuse(cache, order, occ, mask, rope), f"{what} was not refused"
        want = _expected(cache, hist_k, hist_v, q, mask, rope, attn_mask)
        assert (out - want).abs().max() < 1e-12, what
        exact += 1
    assert exact > 0 and refused > 0


def _must_refuse(cache, order, occ, mask, rope):
    chrono_needed = mask == "attn_mask" or rope == "cache_relative"
    if (chrono_needed or order == "chronological") and cache.chronological_refusal:
        return True  # heads hold different positions (or recall slots): no common order
    if order == "physical" and chrono_needed:
        return True  # a chronological mask or cache-relative RoPE needs the gather
    return False


def _may_refuse(cache, occ):
    """Occupancies that would read empty slots or a ragged prefix: refused when not exact."""
    if occ in (None, "mask"):
        return False
    if not cache.valid_is_prefix:
        return True
    return occ == "all" and cache.num_valid < cache.layout.capacity


def test_the_matrix_check_can_fail():
    """Control: a reference that forgets the causal mask disagrees with the causal read."""
    cache, hist_k, hist_v = _stream("ring", 9)
    q = torch.randn(B, C, H, D, dtype=torch.float64)
    out, _ = attend(q, cache.read(), causal=True)
    wrong = _expected(cache, hist_k, hist_v, q, "none", "absolute", None)
    assert (out - wrong).abs().max() > 1e-3
