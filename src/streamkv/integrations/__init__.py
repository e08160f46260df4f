"""Bridges from streamkv caches to other libraries (optional extras).

- :mod:`streamkv.integrations.transformers`: Hugging Face transformers 5.x ``Cache`` objects
  backed by streamkv caches, and the ``"streamkv"`` attention function
  (``pip install streamkv[transformers]``);
- :mod:`streamkv.integrations.diffusers` (with :mod:`~streamkv.integrations.wan_attention`):
  diffusers' Wan transformer as a chunk-streaming causal generator
  (``pip install streamkv[diffusers]``).

Nothing is imported here: each bridge imports its library only when it is imported itself.
"""
