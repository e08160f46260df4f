"""A small causal Wan-style DiT that runs the caches end to end."""

from .config import CONFIGS, DiTConfig, get_config
from .dit import CausalVideoDiT, CrossKV

__all__ = ["DiTConfig", "CONFIGS", "get_config", "CausalVideoDiT", "CrossKV"]
