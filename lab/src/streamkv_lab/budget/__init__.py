"""The streaming-budget experiments behind ``streamkv budget``.

- :mod:`.recorder` — :class:`Recorder`, an observer that measures any cache against its
  whole history (scoring-chunk mass, error vs full history, holdout, the per-query oracle);
- :mod:`.summary` — condensed views of a recording;
- :mod:`.streams` — synthetic heads, the tiny DiT, matched-memory baselines;
- :mod:`.experiment` — :func:`run_streaming_budget` and its plot.
"""

from streamkv_lab.budget.experiment import SCOPE, StreamingBudgetConfig, plot_streaming, run_streaming_budget
from streamkv_lab.budget.recorder import Recorder, StepRecord
from streamkv_lab.budget.streams import (
    SyntheticHeads,
    drive,
    matched_h2o_budget,
    matched_ring_window,
    run_dit_cache,
    run_synthetic_cache,
    synthetic_qkv,
)
from streamkv_lab.budget.summary import summarize

__all__ = [
    "Recorder", "StepRecord", "summarize", "SyntheticHeads", "synthetic_qkv", "drive", "run_synthetic_cache",
    "matched_ring_window", "matched_h2o_budget", "run_dit_cache", "StreamingBudgetConfig", "run_streaming_budget",
    "plot_streaming", "SCOPE",
]
