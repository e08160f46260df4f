"""streamkv-lab: the ``streamkv`` command and what stands behind streamkv's published numbers.

The demo, the benchmarks, the experiments on real weights and real clients, the fuzzers, and the
toy streaming video model with its trained weights. A distribution of its own (``pip install -e
lab`` from the repository, or ``make``): the library ``streamkv`` never imports it.
"""

__version__ = "0.2.0"
