"""``streamkv certify``: certified streaming attention on a synthetic video stream and the tiny
DiT — every query's evicted mass and output error bounded at run time, checked against
full-history attention, with optional recall from the offload store.

``streamkv certify --real``: the two-tier cache (device budget + key sketches + certified recall
from the host) against the ring, the scored caches and the per-query oracle at matched device
memory, on SmolLM2's real attention and on the synthetic video stream
(:mod:`streamkv_lab.experiments.twotier`)."""

from __future__ import annotations

import argparse

from streamkv_lab.errors import UsageError, usage_errors


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--real", action="store_true",
                   help="the two-tier cache vs ring / mass / h2o / tova / the per-query oracle at matched device memory, "
                        "on SmolLM2's attention over real text and on the synthetic video stream")
    p.add_argument("--datasets", default="smollm2,video,toy",
                   help="with --real: comma-separated, of smollm2, video (synthetic Q/K/V), toy (the trained toy video "
                        "model's own Q/K/V); default all three")
    p.add_argument("--tokens", type=int, default=1024, help="with --real: SmolLM2 tokens of the text, default 1024")
    p.add_argument("--lm-layers", default="2,10,20,28", help="with --real: SmolLM2 layers, default 2,10,20,28")
    p.add_argument("--lm-chunk", type=int, default=16, help="with --real: SmolLM2 prefill chunk, default 16")
    p.add_argument("--video-frames", type=int, default=48, help="with --real: frames of the video stream, default 48")
    p.add_argument("--toy-frames", type=int, default=48,
                   help="with --real: frames the toy video model streams (4 context, the rest generated), default 48")
    p.add_argument("--perplexity", action="store_true",
                   help="with --real: also SmolLM2's perplexity with every layer on the two-tier cache vs the full "
                        "cache, the ring and TOVA at matched device memory (transformers integration; ~8 min)")
    p.add_argument("--cache", default="ring",
                   help="the cache kind to certify (any of streamkv.policies.POLICIES: ring, mass, tova, ...); "
                        "default ring")
    p.add_argument("--sketch-bits", type=int, choices=(8, 4), default=None,
                   help="summarise evicted keys as per-token 8- or 4-bit sketches (the two-tier cache) instead of "
                        "block boxes")
    p.add_argument("--tau", type=float, default=0.1,
                   help="recall threshold on the certified dropped mass (with --recall; without it the oracle "
                        "column's threshold), default 0.1; with --real: the two-tier cache's recall threshold (and "
                        "the mass cache's tau beside it), default 0.05")
    p.add_argument("--recall", action="store_true",
                   help="recall evicted blocks from the offload store until every query's m_hat <= tau")
    p.add_argument("--recall-slots", type=int, default=None, metavar="N",
                   help="hard capacity of the recall slots per head (default: the stream's whole history)")
    p.add_argument("--budget-tau", type=float, default=0.05,
                   help="the mass cache's own eviction budget (--cache mass), default 0.05")
    p.add_argument("--box-dtype", choices=("float16", "bfloat16", "float32"), default="float16",
                   help="storage dtype of the key boxes (rounded outward), default float16")
    p.add_argument("--pool-events", type=int, default=8,
                   help="eviction events regrouped together by key similarity (0: consecutive blocks), default 8")
    p.add_argument("--block-tokens", type=int, default=24, help="target tokens per summary block, default 24")
    p.add_argument("--max-blocks", type=int, default=None,
                   help="bound the summary blocks per layer by merging the oldest (default: unbounded)")
    p.add_argument("--dit-chunks", type=int, default=None, help="chunks of the DiT rollout (default: its horizon, 32)")
    p.add_argument("--synthetic-frames", type=int, default=128,
                   help="frames of the synthetic stream (16 tokens each; one chunk per frame), default 128")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    p.add_argument("--every", type=int, default=1, metavar="K", help="print every K-th step (default 1: all)")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    p.add_argument("--plot", metavar="PATH", help="plot certificate vs truth over the stream (PNG)")


def _e(x: float) -> str:
    if x != x:  # NaN
        return "-"
    return "0" if x == 0 else f"{x:.2e}"


def _kib(b: float) -> str:
    return f"{b / 1024:.1f}"


#: options of the certified rollouts (without --real) and of the two-tier comparison (--real only)
PLAIN_ONLY = ("cache", "sketch_bits", "recall", "recall_slots", "budget_tau", "box_dtype", "pool_events",
              "block_tokens", "max_blocks", "dit_chunks", "synthetic_frames", "every")
REAL_ONLY = ("datasets", "tokens", "lm_layers", "lm_chunk", "video_frames", "toy_frames", "perplexity")


def _flags(names) -> str:
    return ", ".join(f"--{n.replace('_', '-')}" for n in names)


def _datasets(args: argparse.Namespace) -> list[str]:
    names = [n.strip() for n in args.datasets.split(",") if n.strip()]
    bad = [n for n in names if n not in ("smollm2", "video", "toy")]
    if bad or not names or len(set(names)) != len(names):
        raise UsageError(f"--datasets must name some of smollm2, video, toy (each once), got {args.datasets!r}")
    return names


def _lm_layers(args: argparse.Namespace) -> list[int]:
    try:
        layers = [int(x) for x in args.lm_layers.split(",")]
    except ValueError:
        raise UsageError(f"--lm-layers must be comma-separated integers, got {args.lm_layers!r}") from None
    if any(x < 0 or x > 29 for x in layers) or len(set(layers)) != len(layers):
        raise UsageError(f"--lm-layers must be distinct layers of SmolLM2's 0..29, got {args.lm_layers!r}")
    return layers


def _lm_config(args: argparse.Namespace):
    from streamkv_lab.experiments.twotier_lm import TwoTierLMConfig

    extra = {} if _real_tau(args) is None else {"tau": _real_tau(args)}
    return TwoTierLMConfig(tokens=args.tokens, chunk=args.lm_chunk, **extra)


def _real_tau(args: argparse.Namespace) -> float | None:
    """--tau with --real when given (None: the committed configurations' 0.05)."""
    return args.tau if "tau" in getattr(args, "_given", ()) else None


def check(args: argparse.Namespace) -> None:
    """Every option of the mode that runs is checked, and every option of the other mode refused,
    before any work (:class:`~streamkv_lab.errors.UsageError`): no model is loaded first."""
    from streamkv.budget.mass import check_tau

    given = getattr(args, "_given", set())
    if args.real:
        wrong = [n for n in PLAIN_ONLY if n in given]
        if wrong:
            raise UsageError(f"{_flags(wrong)}: options of the certified rollouts, not of --real (the two-tier "
                             f"comparison); leave them out")
        names = _datasets(args)
        lm = "smollm2" in names or args.perplexity
        unused = [n for n in ("tokens", "lm_chunk") if n in given and not lm]
        unused += [n for n in ("lm_layers",) if n in given and "smollm2" not in names]
        unused += [n for n in ("video_frames",) if n in given and "video" not in names]
        unused += [n for n in ("toy_frames",) if n in given and "toy" not in names]
        unused += [n for n in ("seed",) if n in given and not {"video", "toy"} & set(names)]
        if unused:
            raise UsageError(f"{_flags(unused)}: apply to datasets (or --perplexity) this run does not include "
                             f"(--datasets {args.datasets}); leave them out")
        _lm_layers(args)
        from streamkv_lab.experiments.twotier import least_frames

        if "video" in names:
            from streamkv_lab.experiments.qkv import QKVConfig

            per_frame = QKVConfig().tokens_per_frame  # a chunk per frame
            least = least_frames("video", per_frame, per_frame)
            if args.video_frames < least:
                raise UsageError(f"--video-frames must be >= {least} (a quarter of the stream holds the sinks and two "
                                 f"one-frame chunks), got {args.video_frames}")
        if "toy" in names:
            from streamkv_lab.commands._common import toy_weights_horizon
            from streamkv_lab.video.config import CONTEXT_FRAMES
            from streamkv.models.config import get_config

            toy = get_config("toy")
            least = max(CONTEXT_FRAMES + 1, least_frames("toy", toy.tokens_per_frame, toy.chunk_tokens))
            if (args.toy_frames % toy.frames_per_chunk or args.toy_frames < least
                    or args.toy_frames + toy.sink_frames > toy.max_frames):
                raise UsageError(f"--toy-frames must be a multiple of {toy.frames_per_chunk} (the toy model's chunk), "
                                 f">= {least} (its context, and a quarter of the stream holding its sinks and two "
                                 f"chunks) and <= {toy.max_frames - toy.sink_frames} (its RoPE horizon), "
                                 f"got {args.toy_frames}")
            toy_weights_horizon(None, flag="the toy video model's weights")
        if args.tokens % args.lm_chunk or args.tokens > 8192:
            raise UsageError(f"--tokens must be a multiple of --lm-chunk and <= 8192 (the trained context), "
                             f"got {args.tokens} and {args.lm_chunk}")
        if "smollm2" in names:
            _check_lm_chunk(args.lm_chunk)
        if _real_tau(args) is not None:
            with usage_errors():
                check_tau(args.tau, "--tau")
        if args.perplexity:
            with usage_errors():  # the perplexity run's settings, named
                _lm_config(args).check()
        return
    wrong = [n for n in REAL_ONLY if n in given]
    if wrong:
        raise UsageError(f"{_flags(wrong)}: options of --real (the two-tier comparison); add --real or leave them out")
    with usage_errors():
        check_tau(args.tau, "--tau")
        check_tau(args.budget_tau, "--budget-tau")
    if "recall_slots" in given and not args.recall:
        raise UsageError("--recall-slots bounds the recall slots: it needs --recall")
    if "budget_tau" in given and args.cache != "mass":
        raise UsageError(f"--budget-tau is the mass cache's own budget: it needs --cache mass, got --cache {args.cache}")
    boxes = [n for n in ("box_dtype", "pool_events", "max_blocks") if n in given]
    if args.sketch_bits is not None and boxes:
        raise UsageError(f"{_flags(boxes)}: options of the block boxes, which --sketch-bits replaces; leave them out")
    from streamkv.caches import CACHE_KINDS
    from streamkv.models.config import get_config

    if args.cache not in CACHE_KINDS:
        raise UsageError(f"--cache must be one of {list(CACHE_KINDS)}, got {args.cache!r}")
    horizon = get_config("tiny").max_chunks
    if args.dit_chunks is not None and args.dit_chunks > horizon:
        raise UsageError(f"--dit-chunks must be <= {horizon} (the tiny DiT's RoPE horizon), got {args.dit_chunks}")


def _check_lm_chunk(chunk: int) -> None:
    """``--lm-chunk`` against every SmolLM2 two-tier configuration's device budget (its policy's
    own minimum window), before the model loads."""
    from streamkv.layout import CacheLayout
    from streamkv.policies import make_policy

    from streamkv_lab.experiments.twotier import DEFAULT_CONFIGS
    from streamkv_lab.kinds import kind_params

    for cfg in DEFAULT_CONFIGS["smollm2"]:
        policy = make_policy(cfg.policy, **kind_params(cfg.policy, tau=cfg.tau))
        with usage_errors(what=f"--lm-chunk {chunk} does not fit the SmolLM2 two-tier budget ({cfg.policy}, sink "
                               f"{cfg.sink} + window {cfg.window})"):
            policy.check_layout(CacheLayout(sink=cfg.sink, window=cfg.window, chunk=chunk))


def _real(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from rich.table import Table

    from rich.console import Console

    from streamkv_lab.commands._common import write_json
    from streamkv_lab.env import environment
    from streamkv_lab.experiments.twotier import DEFAULT_CONFIGS, plot_real, run_real, smollm2_stream, video_stream
    from streamkv_lab.video.qkv import toy_stream

    check(args)
    names, layers, tau = _datasets(args), _lm_layers(args), _real_tau(args)
    configs = {n: tuple(c if tau is None else replace(c, tau=tau) for c in DEFAULT_CONFIGS[n]) for n in names}
    builders = {"smollm2": lambda: smollm2_stream(tokens=args.tokens, chunk=args.lm_chunk, layers=layers),
                "video": lambda: video_stream(frames=args.video_frames, seed=args.seed),
                "toy": lambda: toy_stream(frames=args.toy_frames, seed=args.seed)}
    con = Console(width=210)  # the tables are wide
    with con.status("two-tier") as status:
        result = run_real({n: builders[n] for n in names}, configs=configs, progress=status.update)
        if args.perplexity:
            from streamkv_lab.experiments.twotier_lm import run_twotier_lm

            lm = run_twotier_lm(_lm_config(args),
                                progress=lambda name, n: status.update(f"smollm2 perplexity: {name} {n}/{args.tokens}"))
            result["datasets"]["smollm2_lm"] = {"info": {"tokens": args.tokens, "chunk": args.lm_chunk,
                                                         "every_layer": True}, **lm}
    cols = ("device KiB", "budget", "sketch", "recall", "err mean", "p99", "max", "rel mean", "viol",
            "tight med", "p95", "fetched/chunk", "held", "exact need", "shortfalls", "ms/chunk")
    kib = (lambda b: "-" if b is None else f"{b / 1024:.0f}")
    num = (lambda x, f="{:.3g}": "-" if x is None else f.format(x))
    for name, d in result["datasets"].items():
        for i, r in enumerate(d.get("sweep", ())):  # the perplexity dataset is printed below
            cfg = r["config"]
            t = Table(title=f"{name} [{i + 1}/{len(d['sweep'])}]: two_tier = {cfg['policy']} budget {cfg['sink']} + "
                            f"{cfg['window']} tokens, {cfg['sketch_bits']}-bit sketches (blocks of {cfg['sketch_block']}), "
                            f"{cfg['recall_slots']} recall slots, tau {cfg['tau']:g}; the others at its device memory "
                            f"({r['matched_memory_tokens']:.0f} tokens of K/V per layer and key head)")
            t.add_column("cache")
            for c in cols:
                t.add_column(c, justify="right", no_wrap=True)
            for cache, c in r["caches"].items():
                t.add_row(cache, kib(c["device_bytes"]), kib(c.get("budget_kv_bytes")), kib(c.get("sketch_bytes")),
                          kib(c.get("recall_slot_bytes")), num(c["error_mean"]), num(c["error_p99"]),
                          num(c["error_max"]), num(c["rel_error_mean"]), num(c["violations"], "{}"),
                          num(c["tightness_median"]), num(c["tightness_p95"]), num(c["recalled_tokens_per_chunk"], "{:.0f}"),
                          num(c.get("recall_held_tokens"), "{}"), num(c["oracle_recall_tokens"], "{}"),
                          num(c["shortfalls"], "{}"), num(c["ms_per_chunk"], "{:.1f}"))
            con.print(t)
            rt = r["ratios"]
            con.print(f"  ring / two_tier error: mean {rt['ring_over_two_tier_mean']:.2f}x, p99 "
                      f"{rt['ring_over_two_tier_p99']:.2f}x; two_tier / oracle: mean {rt['two_tier_over_oracle_mean']:.3g}x, "
                      f"p99 {rt['two_tier_over_oracle_p99']:.3g}x; recall held / exact need "
                      f"{num(rt['recall_over_oracle_need'])}")
    for name, d in result["datasets"].items():
        if not d.get("tier_sweep"):
            continue
        t = Table(title=f"{name}: the compressed tier's sweep at the two-tier cache's device bytes (tier 1 = "
                        f"full-precision TOVA + recall slots, tier 2 = quantised evicted history, attended; recall "
                        f"planned once per chunk)")
        for c in ("tier 2", "sink+window", "recall", "tier-2 entries", "device KiB", "err mean", "p99", "rel mean",
                  "viol", "tight med", "mass tight", "h2d B/chunk", "shortfalls", "ms/chunk", "ms in cert",
                  "self-forcing h2d ms", "compute floor ms"):
            t.add_column(c, justify="right", no_wrap=True)
        for r in d["tier_sweep"]:
            if "skipped" in r:
                con.print(f"  {r['label']}: not run ({r['skipped']})")
                continue
            g, sf = r["geometry"], r["h2d_self_forcing"]
            t.add_row(r["label"], str(g["sink"] + g["window"]), str(g["recall"]), str(g["capacity"]),
                      kib(r["device_bytes"]), num(r["error_mean"]), num(r["error_p99"]), num(r["rel_error_mean"]),
                      num(r["violations"], "{}"), num(r["tightness_median"]), num(r["mass_tightness_median"]),
                      num(r["h2d_bytes_per_chunk"], "{:.0f}"), num(r["shortfalls"], "{}"),
                      num(r["ms_per_chunk"], "{:.1f}"), num(r["ms_per_chunk_in_certificates"], "{:.1f}"),
                      f"{sf['h2d_ms_per_chunk']:.2f}", f"{sf['compute_floor_ms_per_chunk']:.1f}")
        con.print(t)
        for r in d["tier_sweep"]:
            lo = r.get("looseness")
            if lo:
                con.print(f"  {r['label']}: the certificate over the true error, median per part: "
                          + "; ".join(f"{k.replace('_', ' ')} {v['over_true_median']:.3g}x (largest in "
                                      f"{v['dominant_share']:.0%} of rows)" for k, v in lo.items()))
        rt = d["ratios"]
        if "compressed_tier_over_tova_mean" in rt:
            con.print(f"  compressed_tier ({d['caches']['compressed_tier']['label']}, the lowest mean error without a "
                      f"violation): / tova mean {rt['compressed_tier_over_tova_mean']:.3g}x, p99 "
                      f"{rt['compressed_tier_over_tova_p99']:.3g}x; / per_chunk_oracle mean "
                      f"{rt['compressed_tier_over_per_chunk_oracle_mean']:.3g}x, p99 "
                      f"{rt['compressed_tier_over_per_chunk_oracle_p99']:.3g}x; ms / ring "
                      f"{rt['compressed_tier_ms_over_ring']:.3g}x")
    for name, d in result["datasets"].items():
        qr = d.get("quarter")
        if not qr:
            continue
        t = Table(title=f"{name}: at a quarter of the full cache's bytes ({qr['budget_bytes'] / 1024:.0f} KiB of "
                        f"{qr['full_bytes'] / 1024:.0f}); ms per chunk of each cache in this run, checks excluded")
        for c in ("cache", "device KiB", "err mean", "p99", "viol", "tight med", "ms/chunk", "/ full", "ms in cert"):
            t.add_column(c, justify="right", no_wrap=True)
        full_ms = qr["caches"]["full"]["ms_per_chunk"]
        for cname, c in qr["caches"].items():
            if "skipped" in c:
                con.print(f"  {cname}: not run ({c['skipped']})")
                continue
            t.add_row(cname, kib(c["device_bytes"]), num(c["error_mean"]), num(c["error_p99"]),
                      num(c["violations"], "{}"), num(c["tightness_median"]), num(c["ms_per_chunk"], "{:.2f}"),
                      f"{c['ms_per_chunk'] / full_ms:.2f}x", num(c.get("ms_per_chunk_in_certificates"), "{:.2f}"))
        con.print(t)
    if "smollm2_lm" in result["datasets"]:
        lm = result["datasets"]["smollm2_lm"]
        t = Table(title=f"SmolLM2 perplexity, every layer on the cache ({lm['tokens']} tokens, chunks of "
                        f"{lm['config']['chunk']}); two_tier = {lm['config']['policy']} budget {lm['budget_tokens']} + "
                        f"{lm['config']['recall_slots']} recall slots, tau {lm['config']['tau']:g}; ring / tova at its "
                        f"device memory ({lm['matched_memory_tokens']} tokens)")
        for c in ("cache", "memory tokens", "device KiB", "perplexity", "past the budget", "recalled", "shortfalls",
                  "violations"):
            t.add_column(c, justify="right")
        for name, c in lm["caches"].items():
            t.add_row(name, str(c["memory_tokens"]), kib(c["device_bytes"]), f"{c['perplexity']:.3f}",
                      f"{c['perplexity_past_budget']:.3f}", num(c.get("recalled_tokens"), "{}"),
                      num(c.get("shortfalls"), "{}"), num(c.get("violations"), "{}"))
        con.print(t)
    con.print("errors: L-inf of each (query, head)'s attention output vs float64 full-history attention on the same "
              "inputs, per layer (no compounding); rel = over the head's value range. oracle: the kvbudget seed's "
              "per-query mass budget at the tau whose mean kept tokens equal the memory. fetched: tokens copied from "
              "the host per chunk (x key heads and layers); held / exact need: recalled tokens in the recall slots at "
              "each attention step vs the fewest an exact recall needs for true evicted mass <= tau, (token, key "
              "head) pairs summed over steps; shortfalls: (step, head) pairs where the recall room ran out before "
              "every certificate was <= tau.")
    if args.plot:
        plot_real(result, args.plot)
        con.print(f"plot: {args.plot}")
    if args.json:
        write_json(args.json, {**result, "versions": environment()})
        con.print(f"json: {args.json}")
    quarter = [c for d in result["datasets"].values() for c in ((d.get("quarter") or {}).get("caches") or {}).values()]
    return 0 if all(c["violations"] == 0 for d in result["datasets"].values() for r in d.get("sweep", [d])
                    for c in list(r["caches"].values()) + quarter if c.get("violations") is not None) else 1


def run(args: argparse.Namespace) -> int:
    if args.real:
        return _real(args)
    from rich.console import Console
    from rich.table import Table

    from streamkv_lab.experiments.certify import SummaryOptions, plot_certify, run_certify
    from streamkv_lab.experiments.qkv import QKVConfig
    from streamkv_lab.commands._common import write_json
    from streamkv_lab.env import environment

    check(args)
    summary = SummaryOptions(box_dtype=args.box_dtype, pool_events=args.pool_events or None,
                             block_tokens=args.block_tokens, max_blocks=args.max_blocks, sketch_bits=args.sketch_bits)
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 160))
    with console.status("certified rollouts") as status:
        result = run_certify(
            args.cache, tau=args.tau, recall=args.recall, recall_slots=args.recall_slots, budget_tau=args.budget_tau,
            summary=summary, seed=args.seed, dit_chunks=args.dit_chunks,
            qkv=QKVConfig(frames=args.synthetic_frames,
                          keyframes=tuple(k for k in QKVConfig().keyframes if k < args.synthetic_frames)),
            progress=lambda name, i, n: status.update(f"{name}: chunk {i}/{n}"),
        )

    for name, r in result["runs"].items():
        t = Table(title=f"{name}: {args.cache} cache{' + recall (tau=%g)' % args.tau if args.recall else ''}, per "
                        f"step. err, m: max over the step's rows; m_hat/m: median; recalled: (token, head) "
                        f"pairs brought back; in use / oracle: tokens per head (oracle: fewest an exact recall needs for m <= {args.tau:g}); kept, recall "
                        f"(K/V slots), summ(aries), offl(oaded K/V): KiB")
        for c in ("step", "rows", "viol", "true err", "cert err", "true m", "cert m", "m_hat/m", "recalled",
                  "in use", "oracle", "kept", "recall", "summ", "offl", "summ/KV"):
            t.add_column(c, justify="right", no_wrap=True)
        for i, st in enumerate(r["steps"]):
            if i % args.every and i != len(r["steps"]) - 1:
                continue
            t.add_row(str(st["chunk"]), str(st["rows"]), str(st["violations"]), _e(st["true_err_max"]),
                      _e(st["cert_err_max"]), _e(st["true_mass_max"]), _e(st["cert_mass_max"]),
                      "-" if st["tightness_median"] != st["tightness_median"] else f"{st['tightness_median']:.2f}",
                      str(st["recalled_tokens"]), str(st["recall_in_use"]), str(st["oracle_recall"]),
                      _kib(st["kept_kv_bytes"]), _kib(st["recall_kv_bytes"]),
                      _kib(st["summary_bytes"]), _kib(st["offloaded_kv_bytes"]),
                      f"{100 * st['summary_bytes_ratio']:.2f}%")
        console.print(t)

    t = Table(title="totals (rows = (query, head) pairs of every attention step: layer x pass x chunk)")
    t.add_column("")
    for name in result["runs"]:
        t.add_column(name, justify="right")
    rows = [
        ("queries checked", "queries_checked", str),
        ("  with evicted tokens", "nontrivial", str),
        ("violations (mass or error)", "violations", str),
        ("bookkeeping mismatches", "count_mismatch", str),
        ("tightness m_hat/m median", "tightness_median", lambda x: f"{x:.3g}"),
        ("tightness m_hat/m p95", "tightness_p95", lambda x: f"{x:.3g}"),
        ("Z_hat/Z_D median", "partition_ratio_median", lambda x: f"{x:.3g}"),
        ("Z_hat/Z_D p95", "partition_ratio_p95", lambda x: f"{x:.3g}"),
        ("summary bytes / summarised K/V", "summary_bytes_ratio", lambda x: f"{100 * x:.2f}%"),
        ("  <= 3% from chunk", "summary_bytes_ratio_le_3pct_from_chunk", str),
        ("recall events (steps)", "recall_events", str),
        ("recalled tokens (x heads)", "recalled_tokens", str),
        ("recall slots used (peak) / capacity", None, None),
        ("oracle recall need (peak tokens/head)", "oracle_recall_peak", str),
        ("recall shortfalls", "recall_shortfalls", str),
        (f"rows with m_hat > tau={args.tau:g}", "over_tau", str),
        ("max true error", "true_err_max", _e),
        ("max certified error", "cert_err_max", _e),
        ("wall (s)", "wall_s", lambda x: f"{x:.1f}"),
    ]
    for label, key, fmt in rows:
        if key is None:
            t.add_row(label, *[f"{r['recall_peak_slots_used']} / {r['recall_slots']}" for r in result["runs"].values()])
        else:
            t.add_row(label, *[fmt(r.get(key)) if r.get(key) is not None else "-" for r in result["runs"].values()])
    console.print(t)
    t = Table(title="tightness by true dropped mass m (rows with evicted tokens): m_hat / m and m_hat")
    for c in ("rollout", "true m", "rows", "m_hat/m median", "m_hat/m p95", "m_hat median", "m_hat p95"):
        t.add_column(c, justify="right")
    for name, r in result["runs"].items():
        for b in r.get("tightness_by_true_mass", []):
            t.add_row(name, f"[{b['true_mass'][0]:g}, {b['true_mass'][1]:g})", str(b["rows"]),
                      f"{b['ratio_median']:.3g}", f"{b['ratio_p95']:.3g}", f"{b['cert_mass_median']:.3g}",
                      f"{b['cert_mass_p95']:.3g}")
    console.print(t)
    ok = all(result[k] == 0 for k in ("violations", "count_mismatch", "duplicate_positions", "kept_outside_history"))
    console.print(
        f"queries_checked {result['queries_checked']}, violations {result['violations']}, tightness median "
        f"{result['tightness']['synthetic']['median']:.3g} (synthetic) / {result['tightness']['dit']['median']:.3g} (DiT), "
        f"p95 {result['tightness']['synthetic']['p95']:.3g} / {result['tightness']['dit']['p95']:.3g}, "
        f"summary_bytes_ratio {100 * result['summary_bytes_ratio']:.2f}%, recall_events {result['recall_events']}, "
        f"recalled_tokens {result['recalled_tokens']}"
        + (f", rows over tau {result['over_tau']}" if args.recall else "")
        + ("" if ok else "  [FAILED: see violations / mismatches]")
    )
    console.print("The certificate bounds each step's eviction error against full-history attention of that "
                  "step's queries; the DiT has random weights, so its attention is diffuse and its true dropped "
                  "mass is large (the certificate is near 1 there, and so is the truth).")
    if args.plot:
        console.print(f"plot: {plot_certify(result, args.plot)}")
    if args.json:
        write_json(args.json, {**result, "versions": environment()})
        console.print(f"json: {args.json}")
    return 0 if ok and (not args.recall or result.get("over_tau", 0) == 0) else 1
