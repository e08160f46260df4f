"""Quantised KV storage formats (the public name of :mod:`streamkv.stores.codecs`).

:data:`KV_FORMATS` is the one registry of storage formats (codec classes: ``IntCodec(bits)``,
``Fp8Codec``, ``BF16Codec``); :class:`KVQuant` is the ``quant=`` option of every cache;
:func:`hadamard` the rotated basis. See :mod:`streamkv.stores.codecs` for the formats, their
error bounds and byte counts.
"""

from .stores.codecs import KV_FORMATS, BF16Codec, Codec, Fp8Codec, IntCodec, KVQuant, as_quant, codec_of, hadamard

__all__ = ["KV_FORMATS", "Codec", "IntCodec", "Fp8Codec", "BF16Codec", "KVQuant", "as_quant", "codec_of", "hadamard"]
