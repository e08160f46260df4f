"""The results pages (``docs/results/*.md``) and the README's "results at a glance" rows, rendered
from the JSON files the lab commands wrote into ``docs/results/``: every number on those pages is
read from a JSON file, never typed. Used by ``scripts/gen_docs.py``.

Each entry of :data:`RESULTS` names the command that wrote the JSON, its plots, what the run
covers (its scope) and a function that turns the JSON into a table and the one-line summary the
README shows. A JSON file that is not there (the command was not run) gives no page.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parents[1] / "docs" / "results"


def g(x: float, digits: int = 3) -> str:
    """A number as the pages print it: 3 significant digits, thousands separated."""
    if x is None:
        return ""
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def pct(x: float) -> str:
    return f"{x:+,.0f}%" if abs(x) >= 10 else f"{x:+.2g}%"


def mib(n: float) -> str:
    return "0 B" if n == 0 else f"{n / 2**20:.2f} MiB"


@dataclass(frozen=True)
class Result:
    name: str            # page and JSON stem
    title: str
    command: str         # the command line that writes the JSON (and plots)
    plots: tuple[str, ...]
    scope: str
    render: Callable[[dict[str, Any]], tuple[str, str, str]]  # -> (table markdown, glance claim, glance number)


def render_verify(d):
    rows = ["| cache | layouts | comparisons | identical K/V in position order | max attention difference (float64, abs) |",
            "|---|---|---|---|---|"]
    for kind in d["identical"]:
        rows.append(f"| {kind} | {d['layouts']} | {d['comparisons']:,} | {d['identical'][kind]:,} | "
                    f"{d['max_attention_diff'][kind]:.1e} |")
    glance = "the ring and the chronological cache equal a whole-history reference"
    number = (f"{d['identical']['ring']:,} / {d['comparisons']:,} comparisons identical; "
              f"attention within {d['max_attention_diff']['ring']:.1e} ({d['dtype']})")
    return "\n".join(rows), glance, number


def render_rollout(d):
    kinds = [k for k in d["max_abs_diff"]]
    rows = ["| cache | max abs difference from the chronological cache | relative to the output scale | "
            "ms per chunk | maintenance ms per chunk |", "|---|---|---|---|---|"]
    scale = d["output_scale"]
    for k in kinds:
        rows.append(f"| {k} | {d['max_abs_diff'][k]:.2e} | {d['max_abs_diff'][k] / scale:.2e} | "
                    f"{g(d[k]['chunk_latency_ms'])} | {g(d[k]['maintenance_ms'])} |")
    rows.append(f"| chronological | 0 | 0 | {g(d['chronological']['chunk_latency_ms'])} | "
                f"{g(d['chronological']['maintenance_ms'])} |")
    glance = "a whole video rollout (the library's small DiT, guidance, a prompt switch) on the ring"
    number = (f"max difference from the chronological cache {d['max_abs_diff']['ring']:.2e} "
              f"on an output scale of {scale:.2f}")
    return "\n".join(rows), glance, number


LABELS = {"current": "chronological (the window rolled left on overflow)",
          "flashdreams": "flashdreams 0.1.0 `BlockKVCache`", "ring": "ring"}


def render_bench(d):
    out = []
    for name, p in d["presets"].items():
        ms, floor = p["maintenance_ms"], p["floor_ms"]
        tb = p["transient_bytes"]
        out += [f"**{name}**: {p['preset']['description']}.", "",
                "| cache | maintenance per chunk and layer (median) | / ring | bytes written | transient allocations |",
                "|---|---|---|---|---|"]
        for k in ("current", "flashdreams", "ring"):
            out.append(f"| {LABELS[k]} | {g(ms[k])} ms | {ms[k] / ms['ring']:.2f}x | {mib(p['bytes_moved'][k]['written_total'])} | "
                       f"{mib(tb[k]['allocated_bytes'])} |")
        out.append(f"| floor (a plain copy of the chunk) | {g(floor)} ms | {floor / ms['ring']:.2f}x | | |")
        out += ["", f"ring / floor {p['ratio_ring_over_floor']:.2f}x; the chronological cache / ring "
                f"{p['ratio_current_over_ring']:.1f}x; flashdreams' `BlockKVCache` / ring "
                f"{p['ratio_flashdreams_over_ring']:.1f}x. Other processes used "
                f"{p['timing']['foreign_cpu_share']:.0%} of the CPUs while it was timed; the run's notes: "
                + "; ".join(p["notes"]) + "."]
    p = next(iter(d["presets"].values()))
    glance = "cache maintenance per chunk at the Self-Forcing shape (Wan 1.3B, one layer)"
    number = (f"ring {p['ratio_ring_over_floor']:.2f}x a plain copy; chronological cache "
              f"{p['ratio_current_over_ring']:.1f}x and flashdreams {p['ratio_flashdreams_over_ring']:.1f}x the ring; "
              f"0 B allocated per chunk by the ring")
    assert p["transient_bytes"]["ring"]["allocated_bytes"] == 0, "the glance says 0 B"
    return "\n".join(out), glance, number


def render_pareto(d):
    rows = ["| tau | mean cache (tokens) | max error | bound tau x value range | within the bound | min kept mass |",
            "|---|---|---|---|---|---|"]
    for r in d["tau_sweep"]:
        rows.append(f"| {r['tau']} | {g(r['mean_cache'])} | {g(r['max_error'])} | {g(r['bound'])} | "
                    f"{'yes' if r['within_bound'] else 'no'} | {g(r['min_kept_mass'], 4)} |")
    p = d["pareto"]
    rows += ["", f"At matched cache sizes, the fixed window's mean error over the mass budget's: median "
             f"{p['ratio_median']:.1f}x, at least {p['ratio_min']:.1f}x; the mass budget better at every size: "
             f"{'yes' if p['mass_better_everywhere'] else 'no'}. Tail at a matched cache of "
             f"{g(d['tail']['mass_cache'])} tokens: window {g(d['tail']['window_max'])}, mass {g(d['tail']['mass_max'])} "
             f"max error ({d['tail']['ratio']:.1f}x).", "", "Claims that would falsify the result:", ""]
    rows += [f"- {f['claim']}: {'**falsified**' if f['falsified'] else 'held'} ({f['detail']})." for f in d["falsifiers"]]
    glance = "a per-query attention-mass budget against a fixed window (synthetic attention with sinks)"
    number = f"window error / mass error at matched memory: median {p['ratio_median']:.1f}x, min {p['ratio_min']:.1f}x"
    return "\n".join(rows), glance, number


def render_budget(d):
    rows = ["| tau | cache | memory mean (tokens) | error mean | error max | holdout mass max |", "|---|---|---|---|---|---|"]
    for grp in d["synthetic"]["groups"]:
        for r in grp["rows"]:
            rows.append(f"| {grp['tau']} | {r['policy']} ({r['param']}) | {g(r['memory_mean'])} | {g(r['err_mean'])} | "
                        f"{g(r['err_max'])} | {g(r.get('holdout_max'))} |")
    rows += ["", "Scope, as the run states it: " + d["scope"]]
    grp = d["synthetic"]["groups"][-1]
    by = {r["policy"]: r for r in grp["rows"]}
    glance = "the streaming mass-budget cache against a window and H2O at matched memory (synthetic)"
    number = (f"at tau {grp['tau']}: mean error {g(by['mass']['err_mean'])} against window "
              f"{g(by['window']['err_mean'])} and H2O {g(by['h2o']['err_mean'])}")
    return "\n".join(rows), glance, number


def render_quant(d):
    full = [r for r in d["rows"] if r["dataset"] == "smollm2" and r["memory_tokens"] == d["smollm2"]["tokens"]]
    bf16 = next(r for r in full if r["cache"] == "streamkv ring bf16")
    rows = ["| cache (all 2,048 tokens held) | bytes per token | perplexity | vs bf16 | attention error mean |",
            "|---|---|---|---|---|"]
    for r in full:
        rows.append(f"| {r['cache']} | {g(r['bytes_per_token'])} | {g(r['perplexity'], 4)} | "
                    f"{pct(100 * (r['perplexity'] / bf16['perplexity'] - 1))} | {g(r['error_mean']) if r['error_mean'] is not None else ''} |")
    q = d["smollm2"]["quarter_bytes"]
    quarter = [r for r in d["rows"] if r["dataset"] == "smollm2" and r["memory_tokens"] < d["smollm2"]["tokens"]
               and r["device_bytes"] <= q and r["bytes_per_token"]]
    rows += ["", f"At a quarter of the bf16 full cache's device bytes ({mib(q)}, full-precision rows counted):", "",
             "| cache | tokens held | perplexity | vs the full bf16 cache |", "|---|---|---|---|"]
    for r in quarter:
        rows.append(f"| {r['cache']} | {r['memory_tokens']} | {g(r['perplexity'], 4)} | "
                    f"{pct(100 * (r['perplexity'] / bf16['perplexity'] - 1))} |")
    tr = d["read"]["transient_ratio_transformers_over_streamkv"]
    rows += ["", f"One read of {d['read']['tokens']:,} cached tokens by {d['read']['queries']} queries: transformers' "
             f"`QuantizedCache` allocates {tr:.1f}x the transient memory of streamkv's quantised read."]
    rows += ["", "Targets the run checked:", ""]
    for t in d["targets"]:
        v = t["value"]
        if isinstance(v, dict):
            shown = f"{v['best_quantised']} {g(v['perplexity'], 4)} against {v['best_bf16']} {g(v['bf16_perplexity'], 4)}"
        elif "perplexity" in t and "bf16" in t:
            shown = pct(100 * (t["perplexity"] / t["bf16"] - 1))
        elif "%" in t["goal"]:
            shown = pct(100 * v)  # a relative change, as its goal is written
        else:
            shown = g(v)
        rows.append(f"- {t['target']}: {shown} (goal {t['goal']}): {'met' if t['met'] else '**not met**'}.")
    best = min(quarter, key=lambda r: r["perplexity"])
    i8 = next(r for r in full if r["cache"] == "streamkv ring int8")
    i4 = next(r for r in full if r["cache"] == "streamkv ring int4")
    glance = "int8 / int4 KV storage on SmolLM2-135M (2,048 tokens of Moby-Dick)"
    number = (f"perplexity vs bf16: int8 {pct(100 * (i8['perplexity'] / bf16['perplexity'] - 1))} at "
              f"{i8['bytes_per_token'] / bf16['bytes_per_token']:.3f}x the bytes per token, int4 "
              f"{pct(100 * (i4['perplexity'] / bf16['perplexity'] - 1))} at "
              f"{i4['bytes_per_token'] / bf16['bytes_per_token']:.3f}x; in a quarter of the full cache's bytes, "
              f"{best['cache'].replace('streamkv ', '')} {pct(100 * (best['perplexity'] / bf16['perplexity'] - 1))}")
    return "\n".join(rows), glance, number


def render_certify(d):
    rows = ["| stream | (query, head) rows checked | certificates below the truth | tightness median (p95): certified / true "
            "dropped mass |", "|---|---|---|---|"]
    for name, t in d["tightness"].items():
        run = d["runs"][name]
        rows.append(f"| {name} | {run['queries_checked']:,} | {run['violations']} | {g(t['median'])} ({g(t['p95'])}) |")
    rows += ["", f"In all: {d['queries_checked']:,} rows checked, {d['violations']} certificates below the truth "
             f"({d['violations_mass']} on the mass, {d['violations_error']} on the output error). The summaries take "
             f"{d['summary_bytes_ratio']:.1%} of the bytes of the K/V they summarise. The largest certified output error "
             f"was {g(d['certified_error_max'])} where the largest true error was {g(d['true_error_max'])}: the bound "
             f"holds and is loose where little mass is dropped."]
    glance = "certificates on the evicted attention (ring; synthetic and DiT attention)"
    number = (f"{d['violations']} certificates below the float64 truth over {d['queries_checked']:,} (query, head) "
              f"rows; summaries {d['summary_bytes_ratio']:.1%} of the K/V bytes")
    return "\n".join(rows), glance, number


def render_positions(d):
    rows = ["| map | layouts (kind x read path) | comparisons | max abs difference from the float64 reference | "
            "recompiles |", "|---|---|---|---|---|"]
    for name, r in d["maps"].items():
        rows.append(f"| `{name}` | {r['layouts']} | {r['comparisons']:,} | {r['max_abs_diff']:.1e} | {r['recompiles']} |")
    sw = d["sliding_window"]
    rows += ["", f"A deliberately wrong map (the current chunk one unit off) differs by {g(d['wrong_map']['max_abs_diff'])}: "
             f"the comparison catches it. Sliding-window models ({', '.join(sw['models'])}): tokens equal to "
             f"transformers' own cache: {'yes' if sw['tokens_equal'] else 'no'}; largest logit difference "
             f"{sw['max_logit_diff']:.1e}."]
    for name, c in d["cost"].items():
        r, ms = c["ratios"], c["ms"]
        rows += ["", f"Cost of one read at the `{name}` preset ({c['slots']:,} slots, {c['queries']} queries, "
                 f"{c['dtype']}): rotating at read took {g(ms['rotate_at_read'])} ms against {g(ms['prerotated'])} ms "
                 f"over keys rotated before the write ({r['rotate_at_read_vs_prerotated']:.1f}x; target "
                 f"`{c['target']}`: {'met' if c['target_met'] else '**not met**'}). At this size a read over pre-rotated keys takes a fraction "
                 f"of a millisecond, and the fixed cost of the block-by-block path dominates; the full run (without "
                 f"`--quick`) times the Self-Forcing and LingBot shapes."]
    worst = max(r["max_abs_diff"] for r in d["maps"].values())
    glance = "every position map with every kind and read path (RoPE at read)"
    number = (f"{sum(r['comparisons'] for r in d['maps'].values()):,} comparisons, largest difference from the "
              f"float64 reference {worst:.1e}")
    return "\n".join(rows), glance, number


def render_read(d):
    r = d["read"]
    out = []
    for name, sh in r["shapes"].items():
        dense = sh["variants"]["dense"]
        out += [f"**{name}** ({dense['tokens']:,} tokens, {sh['queries']:,} query row{'s' if sh['queries'] > 1 else ''}, eager, "
                f"{sh['timing']['repeats']} rounds; other processes used "
                f"{sh['timing']['foreign_cpu_share']:.0%} of the CPUs while it was timed)", "",
                "| read | ms (median) | / the dense bf16 read | bytes held | transient peak |", "|---|---|---|---|---|"]
        for v, row in sh["variants"].items():
            e = row["eager"]
            if e is None:
                continue
            out.append(f"| {v} | {g(e['ms'])} | {e['ratio_vs_dense']:.2f}x | {mib(row['bytes'])} | "
                       f"{mib(e['transient_peak_bytes'])} |")
        out.append("")
    out += ["Targets the run checked (each ratio as measured; a contended sample is marked):", ""]
    for t in r["targets"]:
        out.append(f"- {t['shape']} {t['variant']}: {t['value']:.2f}x ({t['target']}): "
                   f"{'met' if t['met'] else '**not met**'}{' (contended)' if t['contended'] else ''}.")
    met = sum(t["met"] for t in r["targets"])
    paged = [t for t in r["targets"] if t["variant"] == "paged"]
    glance = "one read of every storage format, position map, the compressed tier and a forked branch (CPU)"
    number = (f"{met} of {len(r['targets'])} read-cost targets met; a forked branch's paged read "
              + ", ".join(f"{t['value']:.2f}x" for t in paged) + " the ring's")
    return "\n".join(out), glance, number


def render_fork(d):
    m = d["memory"]
    mem, fk, rd, wr = m["memory"], m["fork"], m["read"], m["write"]
    pre = m["preset"]
    rows = ["| measure | value | target | met |", "|---|---|---|---|",
            f"| pool after {m['branches']} branches write one chunk each / one cache | {mem['ratio_vs_one_cache']:.3f}x "
            f"(the floor: {mem['floor_ratio']:.3f}x; {m['branches']} full copies: {mem['full_copies_ratio']:.0f}x) | "
            f"<= {mem['target_ratio']}x | {'yes' if mem['target_met'] else '**no**'} |",
            f"| fork({m['branches']}) time / one chunk's attention | {fk['fork_over_attention']:.4%} "
            f"({g(fk['median_s'] * 1e3)} ms; {fk['bytes_copied_by_fork']} K/V bytes copied) | <= {fk['target_share']:.0%} | "
            f"{'yes' if fk['target_met'] else '**no**'} |",
            f"| a forked branch's read / the ring's ({rd['query_rows']} query rows) | {rd['paged_forked_over_ring']:.2f}x "
            f"(unforked paged {rd['paged_identity_over_ring']:.2f}x) | <= {rd['target_ratio']}x | "
            f"{'yes' if rd['target_met'] else '**no**'} |",
            f"| a forked branch's chunk write / the ring's | {wr['paged_forked_over_ring']:.2f}x | | |"]
    rows += ["", f"The memory floor is one cache plus one private chunk per branch: {m['branches']} branches that each "
             f"write a chunk after the fork cannot hold less than {mem['floor_ratio']:.3f}x at this shape "
             f"({pre['window_frames']} frames, chunks of {pre['chunk_frames']}); the target is below that floor. "
             f"The forked branch's output differs from the ring's by {rd['max_abs_diff_vs_ring']:.2g} "
             f"(bfloat16, another summation order)."]
    glance = f"fork a stream into {m['branches']} branches at the {pre['name']} shape (copy-on-write pages)"
    number = (f"fork {g(fk['median_s'] * 1e3)} ms, 0 bytes copied; memory {mem['ratio_vs_one_cache']:.2f}x one cache "
              f"(floor {mem['floor_ratio']:.2f}x, full copies {mem['full_copies_ratio']:.0f}x); a branch's read "
              f"{rd['paged_forked_over_ring']:.2f}x the ring's")
    return "\n".join(rows), glance, number


def render_chart(d):
    out = []
    for name, sh in d["shapes"].items():
        stream = next(r["error_stream"] for r in d["rows"] if r["shape"] == name)
        loaded = any(r.get("load_slowdown") is not None for r in d["rows"] if r["shape"] == name)
        head = "| cache / format / budget | tokens | bytes / full | ms per chunk | / full | "
        head += "/ full under load | load slowdown | " if loaded else ""
        head += "cache work / ring's | host syncs | relative error mean (p99) |"
        out += [f"**{name}**: {sh['shape']['description']}; errors on {d['errors'][stream]['description']}.", "",
                head, "|---" * head.count(" | ") + "|---|"]
        refused = []
        for r in d["rows"]:
            if r["shape"] != name:
                continue
            if r["not_run"]:
                refused.append(f"{r['key']} ({r['not_run']})")
                continue
            work = "" if r["cache_work_ratio_to_ring"] is None else f"{r['cache_work_ratio_to_ring']:.2f}x"
            under = (f"{r['loaded_ratio_to_full']:.2f}x | {r['load_slowdown']:.2f}x | "
                     if loaded and r.get("load_slowdown") is not None else "| | " if loaded else "")
            out.append(f"| {r['key']} | {r['tokens']:,} | {r['bytes_ratio_to_full']:.2f} | {g(r['ms_per_chunk'])} | "
                       f"{r['ratio_to_full']:.2f}x | {under}{work} | {r['host_syncs_per_chunk']} | "
                       f"{g(r['rel_error_mean'])} ({g(r['rel_error_p99'])}) |")
        out.append("")
        if refused:
            out += [f"Not run at this shape: {'; '.join(refused)}.", ""]
    out += ["Targets the run checked:", ""]
    for t in d["targets"]:
        if t["why_not_measured"]:
            continue
        out.append(f"- {t['shape']} {t['row']}: {t['value']:.2f}x ({t['text']}): {'met' if t['met'] else '**not met**'}.")
    spin = max((sh["timing"].get("load_processes") or 0 for sh in d["shapes"].values()), default=0)
    if spin:
        out += ["", f"Under load: the eager chunks timed again in rounds of their own with {spin} process(es) spinning "
                    f"on the CPUs (every sample kept); the load slowdown is that ratio to the full cache over the quiet "
                    f"one."]
    out += ["", f"Other processes' share of the CPUs and the load averages are in the JSON (`machine`, per shape); the "
            f"whole run took {d['machine']['wall_s'] / 60:.0f} minutes."]
    by = {(r["shape"], r["key"]): r for r in d["rows"] if not r["not_run"]}
    shape = "lingbot-world" if "lingbot-world" in d["shapes"] else next(iter(d["shapes"]))
    parts = [f"{k.split('/')[0] if k.count('/') == 2 and '/bf16/' in k else k.split('/')[0] + ' ' + k.split('/')[1]} "
             f"{by[(shape, k)]['ratio_to_full']:.2f}x" for k in
             ("ring/bf16/tokens:1/4", "tova/bf16/tokens:1/4", "tova/int8/tokens:1/4", "tier/int8/bytes:1/4")
             if (shape, k) in by]
    glance = f"time per chunk (attention + cache work) at a quarter of the memory, against the full cache ({shape})"
    number = "; ".join(parts) + " the full cache's time"
    certified = by.get((shape, "tier+certificates/int8/bytes:1/4"))
    number += (" (CPU, eager; the tier without its certificates" +
               (f", {certified['ratio_to_full']:.2f}x with them)" if certified is not None else ")"))
    return "\n".join(out), glance, number


RESULTS = (
    Result("bench", "Cache maintenance", "streamkv bench --preset self-forcing --no-scaling --no-end-to-end --no-counts "
           "--json docs/results/bench.json", (),
           "One attention layer at the Self-Forcing shape, on the CPU: the time, bytes written and memory allocated to "
           "admit one chunk into a full cache (every step evicts), for the ring, the chronological cache (rolled left "
           "on overflow), flashdreams 0.1.0's `BlockKVCache`, and a plain copy of the chunk into contiguous slots (the "
           "floor: what any cache must at least write). Attention itself is not timed. Medians after warm-up.",
           render_bench),
    Result("verify", "Storage against a whole-history reference", "streamkv verify --json docs/results/verify.json", (),
           "96 layouts (sinks of 0, part of a chunk and whole chunks; windows that are and are not multiples of the "
           "chunk; chunks of 2, 3 and 4 tokens; two token layouts), each through filling, repeated writes, reopened "
           "chunks, the first eviction, at least two wraps and a reset, in float64.", render_verify),
    Result("rollout", "Video rollout parity", "streamkv rollout --compare --threads 1 --json docs/results/rollout.json", (),
           "The library's `tiny` DiT (random weights: this is a parity and cost check, not a quality one) with "
           "guidance 3, streams of 8 and 4 chunks with a switch to a second prompt, the first eviction at chunk 3 "
           "and two wraps of the ring. The scored kinds keep other tokens than the window, so their rows are their "
           "approximation error on random weights, not a defect. Times are medians over the chunks of a run that "
           "shared the CPU with other jobs; at this size (96 tokens of history) cache maintenance is under 2 ms for "
           "every kind and the differences between kinds are within the noise: the cost of maintenance at real "
           "shapes is on the [cache maintenance](bench.md) page.", render_rollout),
    Result("pareto", "Mass budget against a fixed window", "streamkv pareto --json docs/results/pareto.json --plot "
           "docs/results/pareto.png", ("pareto.png", "pareto-sinks.png"),
           "Synthetic attention (48 frames of 8 tokens, recency decay, keyframes with sink tokens, noise); the "
           "mass budget here is the per-query oracle, which sees every query's attention before choosing; errors are "
           "L-infinity against full attention.", render_pareto),
    Result("budget", "The streaming mass-budget cache", "streamkv budget --json docs/results/budget.json --plot "
           "docs/results/budget.png", ("budget.png",),
           "A real cache must evict before later queries arrive. Synthetic per-head streams (4 heads with different "
           "sink strengths and recency), every cache at matched mean memory.", render_budget),
    Result("certify-ring", "Certified attention on the ring", "streamkv certify --json docs/results/certify-ring.json", (),
           "The ring on two streams: synthetic attention with keyframe sinks, and the library's tiny DiT. Evicted "
           "tokens are summarised in blocks of 24 (float16 key boxes rounded outward); every query's certificate is "
           "compared with float64 attention over the whole history. No recall in this run (`--recall` adds it).",
           render_certify),
    Result("positions", "Position maps and RoPE at read", "streamkv positions --quick --json "
           "docs/results/positions.json --plot docs/results/positions.png", ("positions.png",),
           "Every map of the registry with every cache kind, read in physical order and (window kinds) in position "
           "order, through fills and wraps, with causal and window masks, grouped queries, LLM spans and video "
           "chunks, 1D and Wan 3D RoPE, against a float64 reference that keeps every token and rotates raw keys by "
           "the map's plain-Python rule. Also: sliding-window LLMs in transformers, StreamingLLM on SmolLM2, the "
           "cost of rotating at read, and the small video model past its training window (in the JSON). This is the "
           "`--quick` run: the exactness sections are complete; StreamingLLM runs on a tiny Llama instead of "
           "SmolLM2, the cost on the small preset, and the video model 2x (not 8x) past its window.",
           render_positions),
    Result("quant", "Quantised storage", "streamkv quant --clips 1 --json out/quant.json --plot out/quant.png", ("quant.png",),
           "SmolLM2-135M-Instruct (float32) on 2,048 tokens of Moby-Dick in spans of 64, every layer on the cache; "
           "`bf16` is streamkv's bf16 storage of the model's K/V; 4 bits and fewer use the Hadamard basis; "
           "transformers' `QuantizedCache` (quanto, HQQ) beside it. The JSON and plot are that run's, copied here.",
           render_quant),
    Result("fork", "Forks: copy-on-write pages", "streamkv fork --memory --no-video --out out/fork", (),
           "One attention layer at the Self-Forcing shape (bfloat16, one page per chunk) on the CPU: a cache forked "
           "into branches that share every committed page, each then writing one chunk of its own; the pool's pages, "
           "the fork's time against one chunk's attention, and a branch's read and write against the contiguous "
           "ring's, interleaved. Exactness of every branch against a cache that never forked is the suite's "
           "(`streamkv fuzz --forks 20`, the fork tests), not this page's. The run's `out/fork/fork.json` is copied "
           "here.", render_fork),
    Result("read", "The cost of one read", "streamkv bench --read --modes eager --json docs/results/read.json --plot "
           "docs/results/read.png", ("read.png",),
           "One layer at one head's shape of each model (Self-Forcing, LingBot-World, SmolLM2 decoding), read by "
           "the span's queries (a video chunk's 4,680 queries; one decoded token), eager, on a 2-core CPU: every "
           "storage format, every position map (RoPE at read), the compressed tier and a forked branch's paged "
           "read against the dense bf16 read of the same slots. On a CPU the dense read is one fused kernel and "
           "every other read goes through the block loop, which runs the same fused kernel a block at a time; the "
           "Triton read on CUDA is timed by `scripts/gpu_check.py`, which has not run on a GPU for these pages. "
           "One query reading a whole video cache (`--read-queries 1`) is the block loop's worst case: its fixed "
           "cost per block is not shared by a chunk's queries (no target is judged there).",
           render_read),
    Result("chart", "Time per chunk against error", "streamkv chart --shape self-forcing --shape lingbot-world "
           "--shape smollm2-prefill --modes eager --repeats 3 --formats bf16,int8 --budgets tokens:1/2,tokens:1/4,bytes:1/4 "
           "--load 1 --json docs/results/chart.json --plot docs/results/chart.png", ("chart.png",),
           "One layer of each model (one of Self-Forcing's and LingBot-World's heads; SmolLM2's 3 key heads), on a "
           "2-core CPU, eager: per steady chunk, attention plus all cache work (begin, writes, scores, commit), for "
           "the full cache, the ring, each scored kind and the compressed tier, at a half and a quarter of the full "
           "cache's tokens and a quarter of its bytes, bf16 and int8; each row's error from the same caches streaming "
           "the trained toy video model's own Q/K/V (video shapes) or SmolLM2's (LM shapes). A subset of the "
           "command's default grid (the default adds the SmolLM2 decode shape, 1/2 byte budgets, int4 and compiled "
           "rows). A row whose cache cannot be built at a budget (at a quarter of Self-Forcing's tokens a scored "
           "window holds less than the two chunks it needs) is listed as refused. Then every eager chunk again with one "
           "process spinning on one of the two CPUs (a loaded machine).", render_chart),
)


def load(result: Result) -> dict[str, Any] | None:
    path = RESULTS_DIR / f"{result.name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def page(result: Result, data: dict[str, Any]) -> str:
    table, _glance, _number = result.render(data)
    v = data.get("versions") or next(iter(data.get("presets", {}).values()), {}).get("versions", {})
    env = ", ".join(f"{k} {v[k]}" for k in ("streamkv", "torch", "device_name") if k in v)
    plots = "".join(f"\n![{p}]({p})\n" for p in result.plots)
    return (f"# {result.title}\n\nBack to the [results](index.md).\n\n"
            f"- Command: `{result.command}`\n- JSON: [`{result.name}.json`]({result.name}.json)\n"
            f"- Environment (from the JSON): {env}\n\n**Scope.** {result.scope}\n\n{table}\n{plots}")


def glance_rows() -> list[tuple[str, str, str]]:
    """(what, number, page) for the README table."""
    out = []
    for r in RESULTS:
        data = load(r)
        if data is not None:
            _t, glance, number = r.render(data)
            out.append((glance, number, f"{r.name}.md"))
    return out
