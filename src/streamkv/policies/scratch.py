"""A throwaway policy (TOVA's rule under another name): checks that tests survive a registry growing."""

from __future__ import annotations

from torch import Tensor

from .scored import FixedBudget, Scores

__all__ = ["Scratch"]


class Scratch(FixedBudget):
    name = "scratch"

    def priority(self, scores: Scores) -> Tensor:
        return scores.key_sum
