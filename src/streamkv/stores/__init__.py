"""Stores: what holds a cache's K/V (dense buffers, quantised codes), the storage formats
(:data:`KV_FORMATS`, codec classes) and the one read contract (:class:`Segment`).

No format or tier branch lives outside this package: the rest of the library writes through
a :class:`Store` and reads its :class:`Segment` s.
"""

from .base import Segment, Store, WritePlan
from .codecs import KV_FORMATS, BF16Codec, Codec, Fp8Codec, IntCodec, KVQuant, as_quant, codec_of, hadamard
from .dense import DenseStore
from .dims import Dims, check_shape, normalise_dims
from .pages import PageOptions, PagePool, PageTable, as_pages
from .quant import QuantStore

__all__ = ["Segment", "Store", "WritePlan", "DenseStore", "QuantStore", "Dims", "check_shape", "normalise_dims",
           "KV_FORMATS", "Codec", "IntCodec", "Fp8Codec", "BF16Codec", "KVQuant", "as_quant", "codec_of", "hadamard",
           "make_store", "PageOptions", "PagePool", "PageTable", "as_pages"]


def make_store(dims: Dims, *, quant: object, num_layers: int, dtype, device, sink: int, capacity: int,
               per_head: bool, buffers=None, pages: object = None) -> Store:
    """The store a cache's options ask for: quantised codes (``quant``) or dense buffers, in pages
    (``pages``: :class:`PageOptions`) or not."""
    q, opts = as_quant(quant), as_pages(pages)
    if buffers is not None and (q is not None or opts is not None):
        raise ValueError(f"buffers= are dense rows in slot order: they cannot be given with "
                         f"{'quant=' if q is not None else 'pages='}")
    table = None
    if opts is not None:
        page = opts.page or dims.chunk
        rows = dims.slots - (sink if q is not None and q.sinks else 0)
        own = max(1, -(-rows // page))
        # default spare: a branch's worth, and one per kept boundary (each may pin a version of every page)
        pool = PagePool(own + (own * (1 + opts.history) if opts.spare is None else opts.spare), page)
        table = PageTable(pool, pool.take(own, "a new cache"), device if str(device) != "meta" else "meta")
    if q is None:
        store = DenseStore(dims, num_layers=num_layers, dtype=dtype, device=device, buffers=buffers, table=table)
        if table is not None:
            store.takes_buffers = False
        return store
    return QuantStore(dims, q, num_layers=num_layers, dtype=dtype, device=device, sink=sink, capacity=capacity,
                      per_head=per_head, table=table)
