"""The README's examples, run as written (the API loop for every cache kind)."""

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _block(after: str) -> str:
    text = README.read_text()
    start = text.index(after)
    m = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert m, f"no python block after {after!r}"
    return m.group(1)


@pytest.mark.parametrize("kind", ["ring", "chronological", "mass", "h2o", "tova"])
def test_the_api_loop_runs_for_every_kind(kind):
    code = _block("## The API in one loop")
    assert '"ring",' in code
    code = code.replace('"ring",', f'"{kind}", tau=0.05,' if kind == "mass" else f'"{kind}",', 1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    caches, out = scope["caches"], scope["out"]
    assert out.shape == (1, 16, 4, 32) and torch.isfinite(out).all()
    for branch in ("cond", "uncond"):
        cache = caches[branch]
        assert cache.next_chunk == 12 and not cache.is_open
        assert (cache.slot_positions >= 0).sum() > 0
    if kind != "chronological":  # the ring and the scored kinds: nothing moved, sinks pinned
        assert (caches["cond"].slot_positions[..., :16] == torch.arange(16)).all()


def test_the_transformers_example_runs(tmp_path):
    """The README's generate() example on a tiny random Llama saved locally (``name``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tiny")
    code = _block("### transformers")
    scope = {"name": str(tmp_path / "tiny"), "ids": torch.randint(1, 64, (1, 300))}
    exec(compile(code, "README.md", "exec"), scope)
    out = scope["out"]
    assert out.shape == (1, 364) and torch.equal(out[:, :300], scope["ids"])
    assert scope["cache"].get_seq_length() == 363  # 300 + 64 entered, the last token never fed back
