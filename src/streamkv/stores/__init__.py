"""Stores: what holds a cache's K/V (dense buffers, quantised codes), the storage formats
(:data:`KV_FORMATS`, codec classes) and the one read contract (:class:`Segment`).

No format or tier branch lives outside this package: the rest of the library writes through
a :class:`Store` and reads its :class:`Segment` s.
"""

from .base import Segment, Store, WritePlan
from .codecs import KV_FORMATS, BF16Codec, Codec, Fp8Codec, IntCodec, KVQuant, as_quant, codec_of, hadamard
from .dense import DenseStore
from .dims import Dims, check_shape, normalise_dims
from .quant import QuantStore

__all__ = ["Segment", "Store", "WritePlan", "DenseStore", "QuantStore", "Dims", "check_shape", "normalise_dims",
           "KV_FORMATS", "Codec", "IntCodec", "Fp8Codec", "BF16Codec", "KVQuant", "as_quant", "codec_of", "hadamard",
           "make_store"]


def make_store(dims: Dims, *, quant: object, num_layers: int, dtype, device, sink: int, capacity: int,
               per_head: bool, buffers=None) -> Store:
    """The store a cache's options ask for: quantised codes (``quant``) or dense buffers."""
    q = as_quant(quant)
    if q is None:
        return DenseStore(dims, num_layers=num_layers, dtype=dtype, device=device, buffers=buffers)
    if buffers is not None:
        raise ValueError("quantised storage allocates its own codes: buffers= cannot be given with quant=")
    return QuantStore(dims, q, num_layers=num_layers, dtype=dtype, device=device, sink=sink, capacity=capacity,
                      per_head=per_head)
