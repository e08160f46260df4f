"""Certified streaming attention: a run-time bound on what eviction costs every query, and
recall from an offload tier when the bound exceeds a threshold.

- :mod:`~streamkv.certify.bound` — the certificate (logit box bound -> evicted partition
  bound -> dropped-mass bound -> per-channel output error bound), with the proof and the
  floating-point allowance.
- :mod:`~streamkv.certify.summary` — per (layer, head) block summaries of evicted tokens
  (count, key box), grouping by key similarity, bounded memory by merging.
- :mod:`~streamkv.certify.store` — the host offload store (pinned + non_blocking on CUDA).
- :mod:`~streamkv.certify.certifier` — :class:`Certifier`, the observer that summarises and
  offloads evicted tokens, certifies every attention step and recalls into the cache's recall
  slots (a storage option: ``recall_slots=R``).
- :mod:`~streamkv.certify.shadow` — :class:`HistoryCheck`, the whole-history float64
  reference that checks every certificate.

The experiments behind ``streamkv certify`` live in :mod:`streamkv_lab.experiments.certify`.

Prior art: the per-channel min/max key box and its logit bound are Quest's page metadata
(Tang et al., ICML 2024, arXiv 2406.10774), used there to rank pages for sparse reads. What
is new here is the certificate on top of it — a deterministic bound, at run time, on the
mass and the output error of tokens a streaming cache has *evicted*, for every query,
and recall that keeps it under a threshold.
"""

from .bound import Certificate, certify
from .certifier import CertificateMonitor, Certifier, attach
from .shadow import HistoryCheck
from .store import OffloadStore
from .summary import BlockSummaries

__all__ = [
    "Certificate",
    "certify",
    "BlockSummaries",
    "OffloadStore",
    "Certifier",
    "CertificateMonitor",
    "attach",
    "HistoryCheck",
]
