"""What ``streamkv lm-eval`` runs (:class:`LMEvalConfig`), without importing torch (the CLI
reads the defaults when it builds its parser). See :mod:`.lm_eval` for the evaluation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from streamkv_lab.kinds import WINDOW, check_kinds, compared_kinds, kind_params

__all__ = ["LMEvalConfig", "cache_runs", "plan_tokens"]


@dataclass(frozen=True)
class LMEvalConfig:
    """What :func:`evaluate` runs (see the module docstring). ``taus``: of the streaming mass
    cache; ``oracle_taus``: of the oracle; ``error_stride``: every k-th position's queries
    are measured for the attention error; ``oracle_span``: the oracle's forward length (its
    result does not depend on it: it reads the full history)."""

    tokens: int = 16384
    segment: int = 4096
    chunks: tuple[int, ...] = (64,)
    memory: tuple[int, ...] = (256, 1024)
    sink: int = 4
    kinds: tuple[str, ...] | None = None  # None: the window baseline, the ring and every scored kind
    taus: tuple[float, ...] = (0.001, 0.01)
    oracle_taus: tuple[float, ...] = (0.05,)
    decode: int = 32
    error_stride: int = 8
    oracle_span: int = 64

    def check(self, context: int) -> None:
        """Raise ``ValueError`` naming the first setting that cannot run (``context``: the
        model's trained context)."""
        if self.tokens < 2 or self.segment < 2:
            raise ValueError(f"tokens and segment must be >= 2, got {self.tokens} and {self.segment}")
        if self.error_stride < 1 or self.oracle_span < 1 or self.sink < 0:
            raise ValueError(f"error_stride and oracle_span must be >= 1 and sink >= 0, got {self.error_stride}, "
                             f"{self.oracle_span} and {self.sink}")
        if self.segment > context:
            raise ValueError(f"segment ({self.segment}) must not exceed the model's trained context ({context})")
        if self.tokens % self.segment:
            raise ValueError(f"tokens ({self.tokens}) must be a multiple of segment ({self.segment})")
        if not self.chunks or any(c < 1 for c in self.chunks) or len(set(self.chunks)) != len(self.chunks):
            raise ValueError(f"chunks must be distinct ints >= 1, got {self.chunks}")
        check_kinds(self.kinds, compared_kinds())
        C = max(self.chunks)
        if not self.memory or len(set(self.memory)) != len(self.memory):
            raise ValueError(f"memory must be one or more distinct token counts, got {self.memory}")
        for name in ("taus", "oracle_taus"):
            if len(set(getattr(self, name))) != len(getattr(self, name)):
                raise ValueError(f"{name} must be distinct, got {getattr(self, name)}")
        for m in self.memory:
            if not self.sink + 2 * C <= m < self.segment:
                raise ValueError(f"memory {m}: must hold the {self.sink} sinks and two chunks of {C} (scored kinds keep "
                                 f"the newest chunk and room for the next) and be < segment ({self.segment}): "
                                 f"{self.sink + 2 * C} <= memory < {self.segment}")
        if any(not 0 < t < 1 for t in (*self.taus, *self.oracle_taus)):
            raise ValueError(f"taus must be in (0, 1), got {self.taus} and {self.oracle_taus}")
        if any("tau" in kind_params(k) for k in self.run_kinds() if k != WINDOW) and not self.taus:
            raise ValueError("a tau-budgeted kind needs at least one tau")
        if self.decode < 0:
            raise ValueError(f"decode must be >= 0, got {self.decode}")
        if self.decode and (C < 2 or self.split() < max(self.memory, default=0)):
            raise ValueError(f"decode ({self.decode}) needs a largest chunk >= 2 (got {C}) and a prefill (to the last "
                             f"chunk boundary before segment - decode = {self.segment - self.decode}) of at least the "
                             f"largest memory ({max(self.memory, default=0)}), got {self.split()}")

    def run_kinds(self) -> tuple[str, ...]:
        """The kinds this configuration compares (the default: :func:`~streamkv_lab.kinds.compared_kinds`)."""
        return check_kinds(self.kinds, compared_kinds())

    def split(self) -> int:
        """Where the token-by-token tail starts: the last boundary of the largest chunk at or
        before ``segment - decode`` (``segment`` without a tail)."""
        if not self.decode:
            return self.segment
        C = max(self.chunks)
        return max(0, self.segment - self.decode) // C * C


def cache_runs(cfg: LMEvalConfig) -> list[tuple[str, str, dict[str, Any]]]:
    """``(label, kind, build kwargs)`` of the bounded caches at one memory (memory added later)."""
    out = []
    for kind in cfg.run_kinds():
        if kind == WINDOW:
            out.append((WINDOW, "ring", {"sink": 0}))
        elif "tau" in kind_params(kind):  # a tau-budgeted kind: one run per tau
            out += [(f"{kind}(tau={t:g})", kind, {"sink": cfg.sink, **kind_params(kind, tau=t)}) for t in cfg.taus]
        else:
            out.append((kind, kind, {"sink": cfg.sink, **kind_params(kind)}))
    return out


def plan_tokens(cfg: LMEvalConfig) -> int:
    """Tokens fed through the model by :func:`evaluate` (for a progress bar)."""
    per_mode_caches = len(cfg.memory) * len(cache_runs(cfg))
    n = cfg.tokens * (per_mode_caches * len(cfg.chunks) + 1 + len(cfg.oracle_taus) * len(cfg.chunks))
    segments = cfg.tokens // cfg.segment
    if cfg.decode:
        n += segments * cfg.decode * (per_mode_caches + 1 + len(cfg.oracle_taus))
    return n
