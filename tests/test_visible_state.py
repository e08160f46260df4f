"""What a cache holds is visible: its repr and report() name the format, the position map and the
device, and count the bytes held (codes, scales, full-precision rows) beside what a plain bfloat16
cache of the same slots holds; the counts add up to the bytes the store allocated."""

import pytest
import torch

from streamkv import CacheSet, KVCache
from streamkv.quant import KV_FORMATS
from streamkv.rope_at_read import RopeAtRead
from streamkv.rotary import Rope1D

SHAPE = (1, 64, 4, 32)


@pytest.mark.parametrize("fmt", [None, *KV_FORMATS])
def test_repr_and_report_show_format_and_bytes(fmt):
    c = KVCache(SHAPE, SHAPE, seq_dim=1, sink=16, window=48, chunk=16, policy="ring", quant=fmt,
                dtype=torch.bfloat16)
    st = c.report()["storage"]
    assert st["format"].startswith(fmt or "bfloat16") and st["format"] in repr(c)
    assert st["bf16_bytes"] == 2 * 64 * 4 * 32 * 2  # slots x heads x (D + Dv) x 2 bytes
    assert st["bytes"] == c.nbytes
    if fmt is None:
        assert st["full_precision_bytes"] == c.nbytes and st["code_bytes"] == 0
    else:  # codes + scales + full-precision rows + their maps are everything the store allocated
        assert st["code_bytes"] + st["scale_bytes"] + st["full_precision_bytes"] + st["map_bytes"] == c.nbytes
        assert st["full_precision_bytes"] > 0 and "full precision" in repr(c)


def test_the_position_map_and_pages_are_shown():
    c = KVCache(SHAPE, SHAPE, seq_dim=1, sink=16, window=48, chunk=16, policy="ring", pages=True,
                rope_at_read=RopeAtRead(Rope1D(32), "sliding_sinks"))
    r = c.report()
    assert r["keys"] == "raw, rotated at read" and r["position_map"] == "sliding_sinks"
    assert "sliding_sinks" in repr(c) and "pages 4 of 16 slots" in repr(c)
    assert r["storage"]["pages"]["pool_used"] == 4
    s = CacheSet("ring", k_shape=SHAPE, v_shape=SHAPE, seq_dim=1, sink=16, window=48, chunk=16, quant="int4",
                 branches=("cond", "uncond"))
    assert "int4" in repr(s) and "plain bf16 set" in repr(s)
