"""``WanStreamingRollout.fork`` on diffusers' own ``WanTransformer3DModel`` (float64): each branch
equals a rollout that never forked, fed the same prefix, then the branch's noise or text states;
every kind of the registry; the forks share one attachment; refusals change nothing."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_state, snapshot
from diffusers import WanTransformer3DModel

from kinds import KINDS, params
from streamkv.integrations.diffusers import StreamingWan, WanStreamingRollout
from streamkv.rollout import Schedule

TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=64)
SCHEDULE = Schedule(timesteps=(1000.0, 500.0))
GEOMETRY = dict(frames_per_chunk=2, sink_frames=1, window_frames=5, height=4, width=4)  # chunk 8, sink 4, window 20
PREFIX, AFTER = 4, 2
TOL = 1e-12


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return WanTransformer3DModel(**TINY).double().eval()


def _text(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 5, 16, generator=g, dtype=torch.float64)


def _kwargs(kind, pages):
    p = params(kind)
    if "budget" in p:
        p["budget"] = 4 + 20 - 8
    return p | ({"pages": pages} if pages else {})


def _rollout(model, kind, pages=None):
    stream = StreamingWan(model, **GEOMETRY, cache=kind, branches=("cond", "uncond"),
                          cache_kwargs=_kwargs(kind, pages))
    roll = WanStreamingRollout(stream, guidance=3.0, schedule=SCHEDULE, seed=3)
    roll.set_prompt(_text(1), _text(2), seed=11)
    return stream, roll


@pytest.mark.parametrize("kind", KINDS)
def test_each_branch_equals_a_rollout_that_never_forked(model, kind):
    stream, root = _rollout(model, kind, {"spare": 12})
    with stream:
        prefix = root.run(PREFIX)
        same, noise, text = root.fork(3, seeds=[None, 7, None], prompt_embeds=[None, None, _text(5)])
        got = {"same": same.run(AFTER), "noise": noise.run(AFTER), "text": text.run(AFTER)}
        parent = root.run(AFTER)
    for name in got:
        ref_stream, ref = _rollout(model, kind)
        with ref_stream:
            assert torch.equal(ref.run(PREFIX), prefix)
            if name == "noise":
                ref.reseed(7)
            if name == "text":
                ref.switch_prompt(_text(5))
            want = ref.run(AFTER)
        assert (got[name] - want).abs().max() <= TOL * max(1.0, float(want.abs().max())), name
    assert (parent - got["same"]).abs().max() <= TOL
    assert (got["noise"] - got["same"]).abs().max() > 1e-3  # the comparison can fail
    assert (got["text"] - got["same"]).abs().max() > 1e-3


def test_forks_share_one_attachment_and_refusals_change_nothing(model):
    plain_stream, plain = _rollout(model, "ring")
    with plain_stream:
        plain.run(1)
        before = snapshot(plain_stream.caches)
        with pytest.raises(ValueError, match="not paged"):
            plain.fork(2)
        assert_same_state(before, snapshot(plain_stream.caches))
    stream, root = _rollout(model, "ring", {"spare": 4})
    root.run(1)
    before = snapshot(stream.caches)
    for call, err, match in (
        (lambda: root.fork(2, seeds=[1]), ValueError, "seeds must be a sequence of n=2"),
        (lambda: root.fork(1, prompt_embeds=[torch.zeros(1, 5, 3)]), ValueError, "text_dim"),
        (lambda: root.fork(0), ValueError, "n must be"),
    ):
        with pytest.raises(err, match=match):
            call()
    assert_same_state(before, snapshot(stream.caches))
    (branch,) = root.fork(1)
    branch.stream.detach()  # one attachment: detaching a fork detaches every stream of it
    assert not stream.attached and not branch.stream.attached
    with pytest.raises(RuntimeError, match="detached"):
        root.generate_chunk()
