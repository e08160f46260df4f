"""``streamkv fork``: every option used or refused before any work, and the measurement's own
claims at a small preset (the pool holds one shared history and the pages each branch wrote; a fork
copies no K/V; a forked branch's paged read gives the contiguous ring's output)."""

from __future__ import annotations

import pytest

from streamkv_lab.cli import main
from test_cli import no_run, refused  # noqa: F401  (the fixture)

REFUSED = [
    (["fork", "--preset", "small"], "--preset: of the --memory measurement, which this run skips"),
    (["fork", "--memory-branches", "2", "--read-repeats", "3"], "--memory-branches, --read-repeats: of the --memory"),
    (["fork", "--no-video"], "--no-video without --memory runs nothing"),
    (["fork", "--memory", "--no-video", "--branches", "2"], "--branches: of the toy video, which --no-video skips"),
    (["fork", "--memory", "--no-video", "--prompt", "x"], "--prompt: of the toy video"),
    (["fork", "--branches", "0"], "--branches must be >= 1, got 0"),
    (["fork", "--memory", "--memory-branches", "0"], "--memory-branches must be >= 1, got 0"),
    (["fork", "--frames", "7"], "--frames must be a multiple of the 2-frame chunk"),
    (["fork", "--frames", "8"], "past the 8-frame prefix"),
    (["fork", "--frames", "300"], "<= 256 (the toy's RoPE horizon)"),
    (["fork", "--prefix-frames", "2"], "--prefix-frames must be a multiple of the toy's 2-frame chunk and >= its 4"),
    (["fork", "--prompt", " "], "--prompt must be a non-empty text"),
    (["fork", "--weights", "/nonexistent.safetensors"], "--weights /nonexistent.safetensors: no such file"),
    (["fork", "--memory", "--preset", "huge"], None),  # argparse: invalid choice (exit 2, its own usage text)
]


@pytest.mark.parametrize("argv, message", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_bad_options_are_refused_before_any_work(no_run, tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    if message is None:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        return
    assert message in refused(argv, capsys)


def test_the_presets_named_for_help_are_the_benchmarks():
    from streamkv_lab.bench.presets import PRESETS
    from streamkv_lab.commands.fork import PRESETS as NAMED

    assert NAMED == tuple(PRESETS)


def test_the_small_preset_measurement_holds_its_claims():
    from streamkv_lab.experiments.fork_memory import fork_memory

    r = fork_memory("small", branches=3, repeats=2, read_repeats=2)
    m, p = r["memory"], r["preset"]
    chunk_pages = p["chunk_tokens"] // m["page_rows"]
    assert m["pages_after_fork"] == m["pages_before_fork"] == m["one_cache_pages"]  # a fork copies no page
    assert r["fork"]["bytes_copied_by_fork"] == 0
    assert m["pages_in_use"] == m["one_cache_pages"] + 3 * chunk_pages  # the history once, each branch its chunk
    assert m["private_pages"][1:] == [chunk_pages] * 3
    assert m["ratio_vs_one_cache"] == pytest.approx(m["floor_ratio"])
    assert not r["read"]["forked_table_identity"]  # the timed read went through moved pages
    assert r["read"]["max_abs_diff_vs_ring"] <= 1e-2  # bfloat16 rounding of another summation order
