"""Kernels of the read path, beside the torch reference (:func:`streamkv.blockread.read_blocks`).

:mod:`streamkv.kernels.triton_read`: the block read in Triton (:func:`triton_read`, and
:func:`why_not`, the reason it cannot serve a plan). Triton is imported on first use only
(``pip install streamkv`` stays torch-only): importing this package does not need it. On CPU
tensors the kernels run in Triton's interpreter: ``TRITON_INTERPRET=1`` set before ``triton`` is
first imported (:func:`interpreter_reason` says when this process cannot).
"""

from .triton_read import KernelConfig, interpreter_reason, triton_read, why_not

__all__ = ["KernelConfig", "interpreter_reason", "triton_read", "why_not"]
