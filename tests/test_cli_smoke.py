"""Every ``streamkv`` subcommand runs end to end (exit status 0) at its smallest size and writes the
JSON keys the README relies on; the list is the parser's, so a new subcommand without a smoke run
fails :func:`test_every_subcommand_has_a_smoke_run`.

A command already run through the CLI by another test file is not run twice: its entry names that
test, and :func:`test_a_smoke_run_elsewhere_runs_the_command` checks that the test exists and
calls ``main`` with that command. ``fuzz`` runs in both places: here with the position-map,
quantised-storage and fork-tree hooks (``--positions``, ``--quant``, ``--forks``), which its test
elsewhere does not use.

Every run here takes tens of seconds at most on the shared 2-core machine (``--durations``);
``quant`` and ``lm-eval`` share one load of SmolLM2 (cached per process). Not run, too slow for
the suite: the README's ``quant --clips 1 --json out/quant.json --plot out/quant.png`` with
``--quick`` (175 s measured) and ``lm-eval --json out/lm_eval.json --plot out/lm_eval.png`` with
``--quick`` (282 s); ``test_readme.py`` checks that every command line of the README passes the
checks, and the runs here take the same paths at smaller sizes (lm-eval with its default kinds).
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from streamkv_lab.cli import SUBCOMMANDS, build_parser, main

TESTS = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Elsewhere:
    """The command's end-to-end CLI run lives in another test."""

    file: str
    test: str


#: command -> its smallest run here ("{tmp}": the test's folder, also the working directory), or
#: the test that runs it elsewhere
SMOKE: dict[str, list[str] | Elsewhere] = {
    "demo": Elsewhere("test_demo.py", "demo_run"),  # the module fixture its tests share
    "verify": ["verify", "--json", "{tmp}/verify.json"],  # no size option: the 96-layout grid and the map layouts
    "rollout": Elsewhere("test_rollout.py", "test_cli_rollout_compare_writes_the_parity_json"),
    "bench": Elsewhere("test_bench.py", "test_bench_small_runs_and_writes_well_formed_json"),
    "pareto": Elsewhere("test_pareto.py", "test_cli_writes_json_and_plots"),
    "certify": Elsewhere("test_certify_cli.py", "test_certify_json_with_recall"),
    "budget": Elsewhere("test_streaming_budget.py", "test_cli_writes_json_and_plot"),
    "fuzz": ["fuzz", "--layouts", "1", "--calls", "2", "--positions", "1", "--quant", "2", "--forks", "1", "--json",
             "{tmp}/fuzz.json"],
    "train-toy": ["train-toy", "--steps", "1", "--batch", "1", "--frames", "2", "--out", "{tmp}/w/toy.safetensors"],
    # 18 frames: past the 16-frame training window, so both halves of the README's table are measured
    "video-eval": ["video-eval", "--clips", "1", "--frames", "18", "--capacities", "6", "--position-clips", "0",
                   "--json", "{tmp}/video_eval.json", "--plot", "{tmp}/video_eval.png"],
    # the README's command line as written, with --quick (its smallest size)
    "positions": ["positions", "--json", "out/positions.json", "--plot", "out/positions.png", "--quick"],
    # every part (read, smollm2 with its peers and certificates, video); --quick for what is not given
    "quant": ["quant", "--quick", "--tokens", "16", "--chunk", "8", "--residual", "16", "--cert-tokens", "24",
              "--read-tokens", "16", "--frames", "6", "--json", "{tmp}/quant.json", "--plot", "{tmp}/quant.png"],
    # the toy video with two branches, and the --memory measurement at the small preset
    "fork": ["fork", "--branches", "2", "--frames", "10", "--repeats", "2", "--memory", "--preset", "small",
             "--memory-branches", "2", "--read-repeats", "2", "--out", "{tmp}"],
    # the default kinds (no --kinds: window, ring and every scored kind; mass at each default tau)
    "lm-eval": ["lm-eval", "--tokens", "64", "--segment", "64", "--chunks", "16", "--memory", "36", "--decode", "0",
                "--oracle-taus", "none", "--json", "{tmp}/lm_eval.json", "--plot", "{tmp}/lm_eval.png"],
    # the tiny shapes (one video, one decode: both error streams), every cache (every scored kind of the
    # registry, the tier with and without certificates), eager; after lm-eval: SmolLM2 is loaded already
    "chart": ["chart", "--shape", "tiny-video", "--shape", "tiny-decode", "--formats", "bf16,int8", "--budgets",
              "bytes:1/2", "--modes", "eager", "--repeats", "1", "--threads", "1", "--frames", "16", "--lm-tokens",
              "32", "--lm-layers", "2", "--lm-chunk", "8", "--load", "1", "--json", "{tmp}/chart.json", "--plot",
              "{tmp}/chart.png"],
}

#: what each run here writes: file -> the keys the README (and the command's --help) name; "a.b"
#: is key b inside a, "a[].b" key b of every item of the list or dict a (:func:`lookup`)
WRITES: dict[str, dict[str, tuple[str, ...]]] = {
    "verify": {"verify.json": ("layouts", "comparisons", "identical.ring", "identical.chronological",
                               "max_attention_diff.ring", "max_attention_diff.chronological",
                               "positions[].layouts", "positions[].comparisons", "positions[].max_abs_diff",
                               "positions[].recompiles")},
    "fuzz": {"fuzz.json": ("layouts", "calls", "rejected_calls", "state_changes_after_rejection", "bad_calls_accepted",
                           "mismatches", "certified_layouts", "observer_faults", "certificate_undercounts", "kinds",
                           "positions.layouts", "positions.mismatches", "quant.cases", "quant.slots_checked",
                           "quant.mismatches", "quant.formats", "forks.cases", "forks.leaked_pages",
                           "forks.mismatches")},
    "train-toy": {"w/toy.json": ("command", "seed", "loss_curve", "loss_first", "loss_final_mean_last_5pct", "wall_s",
                                 "check_rollout"),
                  "w/toy.safetensors": (), "w/toy_expected.safetensors": ()},
    "video-eval": {"video_eval.json": ("reference_full_history.err_vs_full_horizon", "caches[].6.err_vs_full_horizon",
                                       "caches[].6.err_vs_full_beyond", "caches[].6.tracking_horizon",
                                       "caches[].6.reentry", "caches[].6.revisit",
                                       "caches[].6.full_history_mass_resident", "chronological_vs_ring_max_abs_diff",
                                       "oracle_per_query_mass"),
                   "video_eval.png": ()},
    "positions": {"out/positions.json": ("maps[].layouts", "maps[].comparisons", "maps[].max_abs_diff",
                                         "maps[].recompiles", "ring_vs_chronological", "wrong_map.caught",
                                         "large_positions", "flashdreams", "sliding_window.tokens_equal",
                                         "sliding_window.streaming_llm", "recache", "cost[].ratios", "cost[].ms",
                                         "cost[].transient_bytes", "long_stream.per_map"),
                  "out/positions.png": ()},
    "quant": {"quant.json": ("rows[].bytes_per_token", "rows[].device_bytes", "rows[].transient_bytes",
                             "rows[].error_mean", "rows[].perplexity", "rows[].certificate_violations",
                             "rows[].tightness_median", "rows[].ms_per_chunk", "targets[].target", "targets[].met",
                             "read.rows", "smollm2.quarter_bytes", "video.quarter_bytes", "config.tokens")},
    "fork": {"fork.json": ("video.branches[].bytes_added_one_chunk_after", "video.branches[].max_abs_diff_vs_unforked",
                           "video.memory.one_chunk_after.ratio_vs_one_cache", "video.memory.one_cache_bytes",
                           "video.time.fork_over_attention", "memory.memory.ratio_vs_one_cache",
                           "memory.memory.floor_ratio", "memory.memory.full_copies_ratio",
                           "memory.fork.fork_over_attention", "memory.read.paged_forked_over_ring",
                           "memory.read.median_ms", "memory.write.median_ms"),
             "fork.gif": (), "fork.png": ()},
    "lm-eval": {"lm_eval.json": ("model", "text", "tokens", "segment", "segments", "chunk", "decode", "caches",
                                 "caches[][].perplexity", "caches[][].attn_error_mean", "caches[][].attn_error_p99",
                                 "oracle", "targets", "config", "command", "wall_s", "versions"),
                "lm_eval.png": ()},
    "chart": {"chart.json": ("rows[].ms_per_chunk", "rows[].ratio_to_full", "rows[].bytes", "rows[].bytes_ratio_to_full",
                             "rows[].tokens", "rows[].rel_error_mean", "rows[].error_mean", "rows[].host_syncs_per_chunk",
                             "rows[].allocations_per_chunk", "rows[].allocator_events_per_chunk", "rows[].cache_work_ms",
                             "rows[].cache_work_ratio_to_ring", "rows[].load_slowdown", "rows[].loaded_ratio_to_full",
                             "rows[].not_run", "targets[].value", "targets[].met",
                             "targets[].threshold", "shapes[].timing.foreign_cpu_share",
                             "shapes[].timing.load_average_before", "errors[].rows", "config.rows", "machine.wall_s"),
              "chart.png": ()},
}


def subcommands() -> set[str]:
    import argparse

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices)


def test_every_subcommand_has_a_smoke_run():
    assert subcommands() == set(SUBCOMMANDS)
    missing, extra = subcommands() - set(SMOKE), set(SMOKE) - subcommands()
    assert not missing, f"subcommands without a smoke run: {sorted(missing)}"
    assert not extra, f"smoke runs of no subcommand: {sorted(extra)}"
    here = {c for c, run in SMOKE.items() if not isinstance(run, Elsewhere)}
    assert here == set(WRITES), "every run here says what it writes"
    for command, run in SMOKE.items():
        if not isinstance(run, Elsewhere):
            assert run[0] == command


def _calls_main_with(tree: ast.AST, command: str) -> bool:
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "main" and node.args
                and isinstance(node.args[0], ast.List) and node.args[0].elts
                and isinstance(node.args[0].elts[0], ast.Constant) and node.args[0].elts[0].value == command):
            return True
    return False


ELSEWHERE = sorted((c, r) for c, r in SMOKE.items() if isinstance(r, Elsewhere))


@pytest.mark.parametrize("command, where", ELSEWHERE, ids=[c for c, _ in ELSEWHERE])
def test_a_smoke_run_elsewhere_runs_the_command(command, where):
    tree = ast.parse((TESTS / where.file).read_text())
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == where.test), None)
    assert fn is not None, f"{where.file} has no {where.test}"
    assert _calls_main_with(fn, command), f"{where.file}::{where.test} does not run `streamkv {command}`"


def test_the_ast_check_can_fail():
    tree = ast.parse("def test_x():\n    assert main(['rollout', '--chunks', '2']) == 0\n")
    assert _calls_main_with(tree, "rollout") and not _calls_main_with(tree, "demo")


def lookup(doc, path: str) -> list:
    """The values at ``path`` ("a.b", "a[].b": every item of a, "a[][].b": of every item of those)
    in ``doc``; KeyError names what is missing."""
    values = [doc]
    for part in path.split("."):
        name, depth = part.rstrip("[]"), (len(part) - len(part.rstrip("[]"))) // 2
        nxt = []
        for v in values:
            if not isinstance(v, dict) or name not in v:
                raise KeyError(f"{path}: no {name!r} in {sorted(v) if isinstance(v, dict) else type(v).__name__}")
            nxt.append(v[name])
        for _ in range(depth):  # "a[]": every item of a ("a[][]": of each item too)
            items = [y for x in nxt for y in (x.values() if isinstance(x, dict) else x)]
            assert items, f"{path}: {name} has no items"
            nxt = items
        values = nxt
    return values


HERE = [c for c, r in SMOKE.items() if not isinstance(r, Elsewhere)]


@pytest.mark.parametrize("command", HERE)
def test_smoke_run(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in SMOKE[command]]
    assert main(argv) == 0, capsys.readouterr().err[-3000:]
    for name, keys in WRITES[command].items():
        path = tmp_path / name
        assert path.is_file() and path.stat().st_size > 0, f"{command} did not write {name}"
        if name.endswith(".json"):
            doc = json.loads(path.read_text())
            for key in keys:
                lookup(doc, key)
            _check(command, doc)


def _check(command: str, doc: dict) -> None:
    """What each run must show beyond its keys: the options it was given took effect."""
    if command == "fuzz":
        assert doc["layouts"] == 1 and doc["positions"]["layouts"] == 1 and doc["quant"]["cases"] == 2
        assert doc["mismatches"] == 0 and doc["quant"]["slots_checked"] > 0
        assert doc["forks"]["cases"] == 1 and doc["forks"]["leaked_pages"] == 0
    elif command == "quant":  # explicit sizes win over --quick; --quick fills the rest
        assert doc["config"] == {**doc["config"], "tokens": 16, "read_tokens": 16, "cert_tokens": 24, "frames": 6,
                                 "clips": 1, "chunk": 8, "residual": 16, "quick": True}
        assert doc["smollm2"]["tokens"] == 16 and doc["read"]["tokens"] == 16 and doc["video"]["frames"] == 6
    elif command == "lm-eval":  # the default kinds ran
        from streamkv_lab.kinds import compared_kinds

        assert {k.split("(")[0] for k in doc["caches"]} == {"full", *compared_kinds()}
    elif command == "positions":  # --quick: the small cost preset, a 2x long stream, a tiny Llama
        assert list(doc["cost"]) == ["small"] and doc["long_stream"]["factor"] == 2
        assert all(r["max_abs_diff"] < 1e-12 for r in doc["maps"].values())
    elif command == "fork":  # the options took effect; every branch exact
        v, m = doc["video"], doc["memory"]
        assert len(v["branches"]) == 2 and v["clip"]["frames"] == 10 and v["max_abs_diff_vs_unforked"] == 0
        assert m["preset"]["name"] == "small" and m["branches"] == 2
    elif command == "chart":  # every cache ran at both shapes; 0 host syncs (none reads the device back)
        from streamkv_lab.bench.chart_rows import chart_caches

        for shape in ("tiny-video", "tiny-decode"):
            rows = {r["key"]: r for r in doc["rows"] if r["shape"] == shape}
            assert {r["cache"] for r in rows.values()} == set(chart_caches())
            assert all(r["ms_per_chunk"] > 0 and r["rel_error_mean"] > 0 for r in rows.values()), shape
            assert rows["full/bf16/all"]["ratio_to_full"] == 1.0
            assert all(r["host_syncs_per_chunk"] == 0 for r in rows.values()), shape
            # --load 1: every eager chunk timed again under load, its slowdown the loaded ratio over the quiet one
            assert all(r["load_slowdown"] == pytest.approx(r["loaded_ratio_to_full"] / r["ratio_to_full"])
                       for r in rows.values()), shape
            assert doc["shapes"][shape]["timing"]["load_processes"] == 1
        assert all(t["met"] == (t["value"] <= t["threshold"]) for t in doc["targets"] if t["value"] is not None)
    elif command == "verify":
        assert doc["identical"]["ring"] == doc["comparisons"] > 0


def test_lookup_finds_nested_keys_and_names_a_missing_one():
    doc = {"a": {"x": [{"b": 1}, {"b": 2}], "y": [{"b": 3}]}, "c": [{"d": 0}]}
    assert lookup(doc, "a[][].b") == [1, 2, 3] and lookup(doc, "c[].d") == [0]
    with pytest.raises(KeyError, match="no 'e'"):
        lookup(doc, "c[].e")
