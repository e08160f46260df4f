"""Forks, rewinds, releases and streams moved between processes, against independent caches.

Every branch of a random fork tree (rewinds and releases interleaved) must equal an unpaged cache
fed the same history: the same attention outputs (float64), the same slots, the same stored K/V;
released branches give every page back; the refusals change nothing."""

from __future__ import annotations

import io
import random
import subprocess
import sys

import pytest
import torch

from streamkv import CacheObserver, CacheSet, KVCache
from streamkv.attention import attend
from streamkv.positions import POSITION_MAPS, position_map
from streamkv.quant import KV_FORMATS
from streamkv.rope_at_read import RopeAtRead
from streamkv.rotary import Rope1D

from kinds import KINDS, params

SINK, WINDOW, CHUNK, H, D = 2, 10, 2, 2, 4
f64 = torch.float64


def _build(kind, *, quant=None, pages=None, rope=None):
    return KVCache((1, SINK + WINDOW, H, D), (1, SINK + WINDOW, H, D), seq_dim=1, sink=SINK, window=WINDOW,
                   chunk=CHUNK, policy=kind, dtype=f64, quant=quant, pages=pages, rope_at_read=rope,
                   **params(kind, **({"budget": SINK + WINDOW - CHUNK} if "budget" in params(kind) else {})))


def _step(cache, data):
    q, k, v = data
    c = cache.next_chunk
    cache.begin_chunk(c)
    out, _ = attend(q, cache.layer(0).update(k, v, q))
    cache.commit_chunk(c)
    return out


def _data(rng: random.Random):
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return tuple(torch.randn(1, CHUNK, H, D, generator=g, dtype=f64) for _ in range(3))


def _same(branch, ref):
    assert torch.equal(branch.slot_positions, ref.slot_positions)
    held = ref.slot_positions[0] >= 0  # [H, S]
    for got, want in ((branch.keys(0), ref.keys(0)), (branch.values(0), ref.values(0))):
        g, w = got.transpose(1, 2)[0], want.transpose(1, 2)[0]  # [H, S, D]
        assert torch.equal(g[held], w[held])


def _clone(ref, kind, quant, rope):
    out = _build(kind, quant=quant, rope=rope)
    out.load_state_dict(ref.state_dict())
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("quant", [None, "int8"])
def test_random_fork_trees_equal_independent_caches(kind, quant):
    rng = random.Random(f"{kind}-{quant}")
    root = _build(kind, quant=quant, pages={"history": 3, "spare": 64})
    ref = _build(kind, quant=quant)
    live = [(root, ref, {})]  # (branch, reference, boundary -> reference state)
    forks = rewinds = releases = 0
    for step in range(50):
        i = rng.randrange(len(live))
        branch, ref, kept = live[i]
        op = rng.random()
        if op < 0.55 or branch.end < 2 * CHUNK:
            data = _data(rng)
            a, b = _step(branch, data), _step(ref, data)
            assert torch.allclose(a, b, rtol=0, atol=1e-12), (step, (a - b).abs().max())
            _same(branch, ref)
            kept[branch.end] = ref.state_dict()  # the boundary this commit reached
        elif op < 0.75 and len(live) < 12:
            n = rng.randint(1, 3)
            for new in branch.fork(n):
                assert new.rewind_chunks == branch.rewind_chunks  # the fork point and the parent's others
                live.append((new, _clone(ref, kind, quant, None), dict(kept)))
            forks += 1
        elif op < 0.9 and branch.rewind_chunks:
            c = rng.choice(branch.rewind_chunks)
            branch.rewind(c)
            ref.load_state_dict(kept[c * CHUNK])
            _same(branch, ref)
            rewinds += 1
        elif len(live) > 1:
            branch.release()
            with pytest.raises(RuntimeError, match="released"):
                branch.begin_chunk(branch.next_chunk)
            live.pop(i)
            releases += 1
    assert forks and rewinds and releases
    pool = root.storage.store.table.pool
    for branch, _, _ in live:
        branch.release()
    assert pool.used == 0 and pool.reserved == 0  # every page back: nothing leaked


@pytest.mark.parametrize("name", list(POSITION_MAPS))
def test_forks_under_every_position_map(name):
    """Raw keys rotated at read by each map: a branch reads as an independent cache does."""
    def rope():
        return RopeAtRead(Rope1D(D), position_map(name, **POSITION_MAPS[name].for_geometry(SINK, SINK + WINDOW, CHUNK)))
    rng = random.Random(name)
    root = _build("ring", pages=True, rope=rope())
    ref = _build("ring", rope=rope())
    for _ in range(4):
        d = _data(rng)
        _step(root, d), _step(ref, d)
    (branch,) = root.fork()
    other = _clone(ref, "ring", None, rope())
    for _ in range(5):
        d, e = _data(rng), _data(rng)
        assert torch.allclose(_step(branch, d), _step(ref, d), rtol=0, atol=1e-12)
        assert torch.allclose(_step(root, e), _step(other, e), rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_a_branch_rewinds_to_its_fork_point_and_before(kind):
    """A branch keeps its parent's boundaries: back at the fork point it continues as its parent
    does from there, and back before it as the parent does from that boundary; the pages come back."""
    rng = random.Random(kind)
    root = _build(kind, pages={"history": 8, "spare": 32})
    for _ in range(5):
        _step(root, _data(rng))
    (branch,) = root.fork()
    assert branch.rewind_chunks == root.rewind_chunks and root.next_chunk in branch.rewind_chunks
    at = dict(pos=root.slot_positions.clone())
    for _ in range(3):
        _step(branch, _data(rng))
    for back in (root.next_chunk, root.next_chunk - 1):
        branch.rewind(back)
        twin = root.fork()[0]
        if back < root.next_chunk:
            twin.rewind(back)
        else:
            assert torch.equal(branch.slot_positions, at["pos"])
        _same(branch, twin)
        d = _data(rng)
        assert torch.equal(_step(branch, d), _step(twin, d))
        twin.release()
    pool = root.storage.store.table.pool
    branch.release()
    root.release()
    assert pool.used == 0 and pool.reserved == 0


def test_branches_share_pages_until_they_write():
    """A fork costs no K/V bytes; each branch then takes one page per chunk it writes (a chunk of
    the ring overwrites a page whole: taken without a copy)."""
    root = _build("ring", pages={"spare": 16})
    rng = random.Random(0)
    for _ in range(8):
        _step(root, _data(rng))
    pool = root.storage.store.table.pool
    own = pool.used
    branches = root.fork(4)
    assert pool.used == own
    for b in branches:
        _step(b, _data(rng))
    assert pool.used == own + 4 * (CHUNK // pool.page)


def test_refusals_change_nothing():
    rng = random.Random(1)
    plain = _build("ring")
    _step(plain, _data(rng))
    with pytest.raises(ValueError, match="not paged"):
        plain.fork()
    kept = plain.state_dict()
    with pytest.raises(ValueError, match="not paged"):  # no pages to give back: refused, the cache stays usable
        plain.release()
    assert all(torch.equal(kept[k], v) if isinstance(v, torch.Tensor) else kept[k] == v
               for k, v in plain.state_dict().items())
    _step(plain, _data(rng))
    group = CacheSet("ring", k_shape=(1, SINK + WINDOW, H, D), v_shape=(1, SINK + WINDOW, H, D), seq_dim=1,
                     sink=SINK, window=WINDOW, chunk=CHUNK, branches=("cond", "uncond"), dtype=f64)
    with pytest.raises(ValueError, match="branch 'cond': release.*not paged"):  # all or nothing
        group.release()
    group.begin_chunk(0)
    c = _build("ring", pages={"spare": 1})
    _step(c, _data(rng))
    c.begin_chunk(c.next_chunk)
    with pytest.raises(ValueError, match="open"):
        c.fork()
    c.layer(0).update(*_data(rng)[1:])
    c.commit_chunk(c.next_chunk - 1)
    with pytest.raises(ValueError, match="rewind"):
        c.rewind(0)
    (b,) = c.fork()
    _step(c, _data(rng))  # takes the one spare page (its next page was shared with the branch)
    before = (c.state_dict(), c.storage.store.table.pool.used)
    with pytest.raises(RuntimeError, match="free page"):
        c.begin_chunk(c.next_chunk)  # needs a page for its own write, and none is free
    after = c.state_dict()
    assert c.storage.store.table.pool.used == before[1]
    assert all(torch.equal(before[0][k], after[k]) if isinstance(after[k], torch.Tensor) else before[0][k] == after[k]
               for k in after)
    b.release()
    _step(c, _data(rng))  # the released branch's pages are free again (and nothing is shared)


def test_a_cache_set_forks_every_branch():
    caches = CacheSet("ring", k_shape=(1, SINK + WINDOW, H, D), v_shape=(1, SINK + WINDOW, H, D), seq_dim=1,
                      sink=SINK, window=WINDOW, chunk=CHUNK, branches=("cond", "uncond"), dtype=f64, pages=True)
    rng = random.Random(2)
    for c in range(3):
        caches.begin_chunk(c)
        for br in caches:
            caches[br].layer(0).update(*_data(rng)[1:])
        caches.commit_chunk(c)
    a, b = caches.fork(2)
    assert list(a) == ["cond", "uncond"] and a["cond"] is not caches["cond"]
    assert torch.equal(a["uncond"].keys(0), caches["uncond"].keys(0))


class _Veto(CacheObserver):
    def prepare(self, change):
        if change.what != "commit":
            raise RuntimeError(f"vetoed {change.what}")


def test_a_refused_change_gives_its_reserved_pages_back_at_once():
    """A forked cache reserves free pages for its copy on write before the observers may veto; a
    veto (or a group member's refusal) gives them back at once, not when the exception that holds
    the plan is collected: a sibling's next write is not refused for want of pages meanwhile."""
    caches = CacheSet("ring", k_shape=(1, SINK + WINDOW, H, D), v_shape=(1, SINK + WINDOW, H, D), seq_dim=1,
                      sink=SINK, window=WINDOW, chunk=CHUNK, branches=("cond", "uncond"), dtype=f64,
                      pages={"spare": 8})
    rng = random.Random(5)
    for _ in range(3):
        caches.begin_chunk(caches["cond"].next_chunk)
        for br in caches:
            caches[br].layer(0).update(*_data(rng)[1:])
        caches.commit_chunk(caches["cond"].next_chunk - 1)
    a, b = caches.fork(2)
    pool = caches["cond"].storage.store.table.pool
    a["uncond"].add_observer(_Veto())  # the second member vetoes: the first's reservation goes back
    kept = []
    for call in (lambda: a["uncond"].reset(), lambda: a["uncond"].begin_chunk(a["uncond"].next_chunk),
                 lambda: a["uncond"].load_state_dict(a["cond"].state_dict()), a.reset,
                 lambda: a.begin_chunk(a["cond"].next_chunk)):
        free = pool.free
        with pytest.raises(RuntimeError, match="vetoed") as info:
            call()
        kept.append(info)  # the exceptions (and the plans they hold) stay alive
        assert pool.reserved == 0 and pool.free == free
    assert pool.free > 0
    _step(b["cond"], _data(rng))  # a sibling writes with the pages a refused change had reserved


STREAM_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_fork import _build, _step, _data
import random
c = _build({kind!r}, quant={quant!r})
c.import_stream({path!r})
rng = random.Random(9)
outs = [_step(c, _data(rng)) for _ in range(3)]
torch.save(torch.stack(outs), {out!r})
"""


@pytest.mark.parametrize("kind,quant", [("ring", None), ("tova", "int4")])
def test_a_stream_moves_to_another_process_exactly(kind, quant, tmp_path):
    rng = random.Random(3)
    c = _build(kind, quant=quant)
    for _ in range(5):
        _step(c, _data(rng))
    path = tmp_path / "stream.skv"
    c.export_stream(str(path))
    rng = random.Random(9)
    want = torch.stack([_step(c, _data(rng)) for _ in range(3)])  # never stopped
    out = tmp_path / "outs.pt"
    script = STREAM_SCRIPT.format(tests=str(__import__("pathlib").Path(__file__).parent), kind=kind, quant=quant,
                                  path=str(path), out=str(out))
    subprocess.run([sys.executable, "-c", script], check=True)
    assert torch.equal(torch.load(out), want)


def test_an_edited_or_mismatched_stream_is_refused():
    rng = random.Random(4)
    c = _build("ring")
    _step(c, _data(rng))
    blob = bytearray(c.export_stream())
    other = _build("ring")
    before = other.state_dict()
    idx = len(blob) // 2
    blob[idx] ^= 0xFF
    with pytest.raises(ValueError, match="checksum|not a streamkv stream"):
        other.import_stream(bytes(blob))
    fmt = next(iter(KV_FORMATS))
    with pytest.raises(ValueError, match=f"stores K/V in full precision, this cache quantised .*{fmt}"):
        _build("ring", quant=fmt).import_stream(c.export_stream())
    with pytest.raises(ValueError, match=f"stores K/V quantised .*{fmt}.*, this cache in full precision"):
        other.import_stream(_build("ring", quant=fmt).export_stream())
    with pytest.raises(ValueError, match="kind|policy"):
        _build("tova").import_stream(c.export_stream())
    # edits the checksum must see: the keys' strides (the same bytes, other elements) and a
    # requires_grad flag (a loaded cache would join an autograd graph that grows with every write)
    payload = torch.load(io.BytesIO(c.export_stream()), weights_only=True)
    state = payload["streams"][""]["state"]
    keys = state["keys"]
    state["keys"] = keys.new_empty(0).set_(keys.untyped_storage(), 0, keys.shape, keys.transpose(2, 3).stride())
    assert not torch.equal(state["keys"], keys)
    for edit in ("strides", "grad"):
        if edit == "grad":
            state["keys"] = keys.clone().requires_grad_()
        buf = io.BytesIO()
        torch.save(payload, buf)
        with pytest.raises(ValueError, match="checksum" if edit == "strides" else "requires grad"):
            other.import_stream(buf.getvalue())
    after = other.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in after if isinstance(after[k], torch.Tensor))


def test_recall_after_a_fork_writes_pages_of_its_own():
    """A compressed tier attached after a fork (parent and branch alike) recalls into recall slots whose
    pages the branches share: each recall copies them on write first, so each stream equals an
    unpaged cache with its own tier, and neither changes the other's rows."""
    from streamkv.certify.tier import CompressedTier

    B, C, S, W, R = 1, 8, 2, 22, 16

    def build(pages):
        return KVCache((B, S + W, H, 16), (B, S + W, H, 16), policy="tova", seq_dim=1, sink=S, window=W, chunk=C,
                       recall_slots=R, dtype=torch.float64, pages=pages, **params("tova"))

    def stream(seed, T=64):
        g = torch.Generator().manual_seed(seed)
        base = torch.randn(B, 1, H, 16, generator=g, dtype=torch.float64)
        q = torch.randn(B, T, H, 16, generator=g, dtype=torch.float64) + 2 * base
        k = torch.randn(B, T, H, 16, generator=g, dtype=torch.float64) + base * torch.rand(
            B, T, 1, 1, generator=g, dtype=torch.float64) * 3
        return q, k, torch.randn(B, T, H, 16, generator=g, dtype=torch.float64)

    def chunk(cache, s, c):
        q, k, v = (x[:, c * C:(c + 1) * C] for x in s)
        cache.begin_tokens(C)
        out = attend(q, cache.layer(0).update(k, v, q), causal=True)[0]
        cache.commit()
        return out

    a, b = stream(0), stream(1)
    parent, ref_a, ref_b = build({"spare": 40}), build(None), build(None)
    for x in (parent, ref_a, ref_b):
        chunk(x, a, 0)
    (branch,) = parent.fork()
    tiers = [CompressedTier(x, fmt="int4", capacity=16, block=8, recall_tau=0.01, causal=True)
             for x in (parent, branch, ref_a, ref_b)]
    for c in range(1, 8):  # equal to float64 rounding (a paged read cuts its blocks at page runs)
        assert torch.allclose(chunk(parent, a, c), chunk(ref_a, a, c), rtol=0, atol=1e-12), c
        assert torch.allclose(chunk(branch, b, c), chunk(ref_b, b, c), rtol=0, atol=1e-12), c
    assert tiers[0].stats["recalled_tokens"] and tiers[1].stats["recalled_tokens"]  # both recalled


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("quant", [None, "int8"])
def test_reopening_the_last_chunk_on_a_fresh_branch_equals_an_independent_cache(kind, quant):
    """A branch's first call reopens the chunk its parent committed last: the branch's host state
    (write ranges, offsets) is its parent's, so it rewrites that chunk's slots, not the sinks."""
    rng = random.Random(f"reopen-{kind}-{quant}")
    root, ref = _build(kind, quant=quant, pages=True), _build(kind, quant=quant)
    for _ in range(5):
        d = _data(rng)
        _step(root, d), _step(ref, d)
    (branch,) = root.fork()
    last = branch.next_chunk - 1
    q, k, v = _data(rng)
    outs = []
    for x in (branch, ref):
        x.begin_chunk(last)
        outs.append(attend(q, x.layer(0).update(k, v, q))[0])
        x.commit_chunk(last)
    assert torch.allclose(outs[0], outs[1], rtol=0, atol=1e-12)
    _same(branch, ref)
    d = _data(rng)
    assert torch.allclose(_step(branch, d), _step(ref, d), rtol=0, atol=1e-12)


def _two_map_rope():
    return RopeAtRead(Rope1D(D), ["sliding_sinks", position_map("block_relative", horizon=SINK + WINDOW)])


def _cut(cache):
    cache.rope_at_read.use("block_relative")
    cache.rope_at_read.map("block_relative").set(cut=3)


def test_the_position_map_state_is_per_branch_and_moves_with_the_stream():
    """The map in use and its dynamic parameters (a RoPE cut) are stream state: a branch that cuts
    moves no other branch; an exported stream, a loaded state dict and a rewind restore them (a
    state of another map state is refused by a cache whose maps cannot take it)."""
    rng = random.Random("rope-state")
    root = _build("ring", pages={"history": 4, "spare": 16}, rope=_two_map_rope())
    ref = _build("ring", rope=_two_map_rope())
    for _ in range(3):
        d = _data(rng)
        _step(root, d), _step(ref, d)
    (branch,) = root.fork()
    assert branch.rope_at_read is not root.rope_at_read
    _cut(branch)  # the branch cuts to a new scene: the root keeps its map
    assert root.rope_at_read.current.name == "sliding_sinks"
    d = _data(rng)
    assert torch.allclose(_step(root, d), _step(ref, d), rtol=0, atol=1e-12)
    # the cut stream, exported and loaded, continues as the branch does
    blob = branch.export_stream()
    moved = _build("ring", rope=_two_map_rope())
    moved.import_stream(blob)
    assert moved.rope_at_read.current.name == "block_relative"
    assert moved.rope_at_read.map("block_relative").settings == {"cut": 3}
    d = _data(rng)
    assert torch.allclose(_step(branch, d), _step(moved, d), rtol=0, atol=1e-12)
    # a rewind to before the cut restores the map then in use
    at = root.end // CHUNK
    _cut(root)
    _step(root, _data(rng))
    root.rewind(at)
    assert root.rope_at_read.current.name == "sliding_sinks"
    d = _data(rng)
    assert torch.allclose(_step(root, d), _step(ref, d), rtol=0, atol=1e-12)
    # a state naming a map this cache does not hold is refused, nothing changed
    state = branch.state_dict()
    state["rope_state"] = {**state["rope_state"], "map": "absolute"}
    with pytest.raises(ValueError, match="rope_state"):
        moved.load_state_dict(state)
    assert moved.rope_at_read.current.name == "block_relative"
    # a reset starts a new stream: the cut stream's map state does not carry over into it
    moved.reset()
    fresh = _build("ring", rope=_two_map_rope())
    assert moved.rope_at_read.state() == fresh.rope_at_read.state()
    for _ in range(3):
        d = _data(rng)
        assert torch.equal(_step(moved, d), _step(fresh, d))


def test_one_branch_cannot_move_the_map_state_its_set_shares():
    """A CacheSet built with one RopeAtRead shares its map state between branches (one ``use`` or
    cut turns every branch). A reset, rewind or load of one branch alone would set that shared state
    under the others: refused, nothing changed (before, the other branch silently read with the
    reset map: 0.55 off); the whole set may, and branches that would take different states may not."""
    g = torch.Generator().manual_seed(2)
    cs = CacheSet("ring", k_shape=(1, SINK + WINDOW, 2, D), v_shape=(1, SINK + WINDOW, 2, D), seq_dim=1, sink=SINK,
                  window=WINDOW, chunk=CHUNK, branches=("cond", "uncond"), dtype=f64, rope_at_read=_two_map_rope(),
                  pages={"history": 4})
    rope = cs["cond"].rope_at_read
    assert cs["uncond"].rope_at_read is rope
    for c in range(4):
        cs.begin_chunk(c)
        if c == 2:
            _cut(cs["cond"])
        for b in cs:
            k, v, q = (torch.randn(1, CHUNK, 2, D, generator=g, dtype=f64) for _ in range(3))
            attend(q, cs[b].layer(0).update(k, v, q))
        cs.commit_chunk(c)
    cut = rope.state()
    saved = cs.state_dict()
    for act in (lambda: cs.reset(branches=["cond"]), lambda: cs["cond"].reset(), lambda: cs["uncond"].rewind(1),
                lambda: cs["cond"].load_state_dict({**saved["cond"], "rope_state": _two_map_rope().state()})):
        with pytest.raises(ValueError, match="other cache"):
            act()
        assert rope.state() == cut and cs["cond"].end == cs["uncond"].end == 4 * CHUNK
    mixed = {"cond": saved["cond"], "uncond": {**saved["uncond"], "rope_state": _two_map_rope().state()}}
    with pytest.raises(ValueError, match="share one RopeAtRead"):
        cs.load_state_dict(mixed)
    assert rope.state() == cut
    cs.rewind(1)  # the whole set: before the cut
    assert rope.current.name == "sliding_sinks"
    cs.load_state_dict(saved)
    assert rope.state() == cut
    cs["cond"].load_state_dict(saved["cond"])  # the state it holds: nothing moves under uncond
    cs.reset()
    assert rope.current.name == "sliding_sinks"


def test_a_stream_continues_only_under_the_custom_map_it_was_rotated_by():
    """Two user maps of one name (closures of one factory) that rotate differently: a stream of one
    is refused by a cache of the other, as a stream of another map is."""
    def scaled(f):
        return lambda inp, units: inp.rank(units).to(torch.float64) * f

    def rope(f):
        return RopeAtRead(Rope1D(D), position_map("custom", fn=scaled(f)))

    rng = random.Random("custom")
    half = _build("ring", rope=rope(0.5))
    for _ in range(3):
        _step(half, _data(rng))
    with pytest.raises(ValueError, match="rope must be"):
        _build("ring", rope=rope(0.25)).import_stream(half.export_stream())
    again = _build("ring", rope=rope(0.5))
    again.import_stream(half.export_stream())  # the same map: continued exactly
    d = _data(rng)
    assert torch.equal(_step(again, d), _step(half, d))


def test_a_reset_or_a_load_forgets_kept_boundaries_and_needs_no_page_for_them():
    """Pages shared only with this cache's own kept boundaries (``history=``) need no copy before a
    reset or a load writes every page: the change forgets those boundaries first. Neither is refused
    for lack of free pages, and nothing leaks."""
    rng = random.Random("reset-history")
    c = _build("ring", pages={"history": 2, "spare": 2})
    ref = _build("ring")
    for _ in range(5):
        d = _data(rng)
        _step(c, d), _step(ref, d)
    pool = c.storage.store.table.pool
    assert pool.free < len(c.storage.store.table.host)  # copying every page would not fit
    state = ref.state_dict()
    c.load_state_dict(state)
    assert c.rewind_chunks == [] and pool.used == len(c.storage.store.table.host)
    d = _data(rng)
    assert torch.allclose(_step(c, d), _step(ref, d), rtol=0, atol=1e-12)
    _step(c, _data(rng))  # keeps boundaries again
    c.reset()
    assert c.end == 0 and c.rewind_chunks == [] and pool.used == len(c.storage.store.table.host)
    fresh = _build("ring")
    d = _data(rng)
    assert torch.allclose(_step(c, d), _step(fresh, d), rtol=0, atol=1e-12)


def test_a_certifier_on_a_branch_recalls_into_pages_of_its_own():
    """The same for a Certifier (key sketches, recall) attached to a branch after the fork: its recalls
    leave the parent's rows as they were, and the branch equals the branch of an identical fork."""
    from streamkv.certify import Certifier

    B, C, S, W, R, T = 1, 8, 2, 22, 16, 64

    def build(pages):
        return KVCache((B, S + W, H, 16), (B, S + W, H, 16), policy="tova", seq_dim=1, sink=S, window=W, chunk=C,
                       recall_slots=R, dtype=torch.float32, pages=pages, **params("tova"))

    g = torch.Generator().manual_seed(0)
    base = torch.randn(B, 1, H, 16, generator=g)
    q = torch.randn(B, T, H, 16, generator=g) + 2 * base
    k = torch.randn(B, T, H, 16, generator=g) + base * torch.rand(B, T, 1, 1, generator=g) * 3
    v = torch.randn(B, T, H, 16, generator=g)

    def chunk(cache, c):
        s = slice(c * C, (c + 1) * C)
        cache.begin_tokens(C)
        out = attend(q[:, s], cache.layer(0).update(k[:, s], v[:, s], q[:, s]), causal=True)[0]
        cache.commit()
        return out

    parent, twin = build({"spare": 40}), build({"spare": 40})  # the twin forks alike: the same page tables
    chunk(parent, 0), chunk(twin, 0)
    (branch,), (ref,) = parent.fork(), twin.fork()
    held = parent.keys(0).clone()
    certs = [Certifier(x, sketch_bits=8, recall_tau=0.01, causal=True) for x in (branch, ref)]
    # key sketches certify float32 keys, and a scored float32 stream's choices follow its rounding: the
    # reference is a branch of an identical fork (a paged read cuts its blocks where its pages run), whose
    # parent keeps no certifier; a recall into a shared page would change the parent's rows
    for c in range(1, T // C):
        assert torch.equal(chunk(branch, c), chunk(ref, c)), c
    assert certs[0].stats["recalled_tokens"] > 0
    assert torch.equal(parent.keys(0), held)


@pytest.mark.parametrize("kind", KINDS)
def test_a_stream_keeping_rewind_boundaries_has_the_pages_to_go_on(kind):
    """Each kept boundary may pin a version of every page: by default the pool has room for them
    (a single stream with pages={'history': 2} was refused after 3 chunks, told to release a
    branch it did not have); a pool made too small says which options give room."""
    for history in (1, 2, 4):
        cache = _build(kind, pages={"page": 1, "history": history})
        rng = random.Random(f"history-{history}")
        for _ in range(3 * history + 6):
            _step(cache, _data(rng))
        assert cache.rewind_chunks
    small = _build(kind, pages={"page": 1, "history": 4, "spare": 1})
    rng = random.Random("small")
    with pytest.raises(RuntimeError, match="keep fewer rewind boundaries"):
        for _ in range(30):
            _step(small, _data(rng))


def test_the_shared_map_guard_counts_live_readers_and_checks_again_when_a_step_runs():
    """A dropped cache no longer reads the map (it may wait for the cycle collector: the guard
    collects before it refuses); a reset prepared before the shared map moved is refused when it
    runs (it set the other branch's map back silently); a RopeAtRead a cache uses builds a CacheSet
    (its meta probe was refused as a cache on another device)."""
    rope = _two_map_rope()
    a = _build("ring", rope=rope)
    del a
    b = _build("ring", rope=rope)
    _cut(b)
    b.reset()  # b alone reads the map now
    assert rope.current.name == "sliding_sinks"
    cs = CacheSet("ring", k_shape=(1, SINK + WINDOW, 2, D), v_shape=(1, SINK + WINDOW, 2, D), seq_dim=1, sink=SINK,
                  window=WINDOW, chunk=CHUNK, branches=("cond", "uncond"), dtype=f64, rope_at_read=rope)
    del b
    step = cs["cond"].prepare_reset()  # the map as built: nothing would move
    _cut(cs["cond"])
    with pytest.raises(ValueError, match="other cache"):
        step.run()
    assert rope.map("block_relative").settings == {"cut": 3}
