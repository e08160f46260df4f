"""``streamkv rollout``: a streaming rollout of the causal DiT on one cache, or all compared.

``--model diffusers-wan`` runs diffusers' ``WanTransformer3DModel`` (random weights) streamed
through the caches instead (:mod:`streamkv_lab.experiments.diffusers_wan`).

``--nproc N`` runs the same rollouts on one process and on ``N`` context-parallel ranks
(Ulysses, started here) and reports their parity and the cache bytes per rank. Under
``torchrun`` (``torchrun --nproc-per-node N -m streamkv_lab.cli rollout ...``; the environment
says so) the ranks are torchrun's: the same comparison, printed and written by rank 0.
"""

from __future__ import annotations

import argparse

CACHES = ("chronological", "ring")


MODELS = ("dit", "diffusers-wan")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", choices=MODELS, default="dit",
        help="dit: the built-in causal DiT (default); diffusers-wan: diffusers' WanTransformer3DModel streamed "
        "through streamkv (random weights; needs the diffusers extra; eager, one process)",
    )
    p.add_argument("--cache", default="ring", help="cache kind when not comparing (default ring)")
    p.add_argument("--compare", action="store_true", help="run every cache kind on the same weights and noise")
    p.add_argument("--chunks", type=int, default=8, help="chunks in the first stream (default 8)")
    p.add_argument("--config", default="tiny", help="model config: tiny (default) or wan2.1-1.3b")
    p.add_argument("--guidance", type=float, default=3.0, help="CFG scale; 1.0 disables the uncond branch (default 3.0)")
    p.add_argument("--mode", choices=["eager", "compile", "graph"], default="eager", help="execution mode")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--seed", type=int, default=0, help="weights and noise seed")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot of latency and maintenance per chunk")
    p.add_argument("--tau", type=float, default=0.05, help="dropped-mass budget of the 'mass' cache (default 0.05)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice; 1 is fastest for the tiny model)")
    p.add_argument(
        "--nproc", type=int, default=1,
        help="context-parallel ranks (Ulysses, gloo on CPU / NCCL on CUDA) started here; > 1 compares them "
        "against a single-process run (default 1)",
    )


def check(args: argparse.Namespace) -> None:
    """Every bound before any work (no model is built first; :class:`~streamkv_lab.errors.UsageError`):
    the cache kinds, the mass cache's ``--tau`` (refused when no mass cache runs), the guidance,
    the model config and its RoPE horizon (``--chunks``), the mode and device, the ranks."""
    import math
    import os

    from streamkv.budget.mass import check_tau
    from streamkv.caches import CACHE_KINDS
    from streamkv_lab.errors import UsageError, usage_errors

    given = getattr(args, "_given", set())
    if args.compare and "cache" in given:
        raise UsageError("--cache names the one cache run without --compare; --compare runs every kind (leave one out)")
    kinds = available_caches() if args.compare else (args.cache,)
    bad = [k for k in kinds if k not in CACHE_KINDS]
    if bad:
        raise UsageError(f"--cache must be one of {list(CACHE_KINDS)}, got {args.cache!r}")
    if "mass" in kinds:
        with usage_errors():
            check_tau(args.tau, "--tau")
    elif "tau" in given:
        raise UsageError(f"--tau is the mass cache's budget: it needs --cache mass or --compare, got --cache {args.cache}")
    if not (math.isfinite(args.guidance) and args.guidance >= 1.0):
        raise UsageError(f"--guidance must be a finite number >= 1 (1 disables the uncond branch), got {args.guidance}")
    torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if torchrun and args.nproc != 1:
        raise UsageError(f"--nproc {args.nproc} under torchrun: the ranks are torchrun's (leave --nproc out)")
    distributed = args.nproc != 1 or torchrun
    if args.model == "diffusers-wan":
        from streamkv_lab.experiments.diffusers_wan import WAN_CONFIGS

        for flag, bad_flag in (("--nproc / torchrun", distributed), ("--mode", args.mode != "eager"),
                               ("--plot", bool(args.plot))):
            if bad_flag:
                raise UsageError(f"{flag} is not available with --model diffusers-wan (eager, one process, no plot)")
        if args.config not in WAN_CONFIGS:
            raise UsageError(f"unknown diffusers-wan config {args.config!r}; choose one of {sorted(WAN_CONFIGS)}")
        geo = WAN_CONFIGS[args.config]
        horizon = geo["model"]["rope_max_seq_len"] // (geo["frames_per_chunk"] // geo["model"]["patch_size"][0])
    else:
        from streamkv.models.config import get_config

        with usage_errors():  # an unknown config, named with the known ones
            cfg = get_config(args.config)
        horizon = cfg.max_chunks
        if args.mode == "graph" and not args.device.startswith("cuda"):
            raise UsageError("--mode graph captures CUDA graphs: it needs --device cuda")
        if distributed:
            from streamkv.distributed import check_split

            if args.plot:
                raise UsageError("--plot is not available with --nproc (the per-chunk timings of ranks are not plotted)")
            if args.nproc > 1:
                with usage_errors():  # heads and tokens that do not split over the ranks
                    check_split(heads=cfg.heads, chunk_tokens=cfg.chunk_tokens, world_size=args.nproc,
                                what=f"config {cfg.name!r}: {cfg.frames_per_chunk} frames x {cfg.tokens_per_frame} "
                                     f"tokens per chunk")
                if args.mode == "graph":
                    raise UsageError(f"--mode graph is not supported with context parallelism (--nproc {args.nproc})")
    if args.chunks > horizon:
        raise UsageError(f"--chunks must be <= {horizon} (the {args.config} model's RoPE horizon in chunks), got "
                         f"{args.chunks}")


def run(args: argparse.Namespace) -> int:
    from streamkv_lab.experiments.rollout_compare import compare_rollouts
    from streamkv_lab.commands._common import console as make_console
    from streamkv_lab.commands._common import write_json
    from streamkv_lab.env import environment
    from streamkv_lab.commands._rollout_report import plot_runs, print_tables, progress_bar

    check(args)  # also when another command runs this one (demo)
    console = make_console()
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    kinds = available_caches() if args.compare else (args.cache,)
    if args.model == "diffusers-wan":
        return _run_diffusers_wan(args, kinds, console)
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return _run_context_parallel(args, kinds, console, launcher="torchrun")
    if args.nproc != 1:
        return _run_context_parallel(args, kinds, console)
    streams = args.chunks + max(1, args.chunks // 2)
    with progress_bar(console) as progress:
        tasks = {k: progress.add_task(f"{k:>14} chunks", total=streams) for k in kinds}
        result = compare_rollouts(
            kinds, config=args.config, chunks=args.chunks, guidance=args.guidance, mode=args.mode,
            device=args.device, seed=args.seed, progress=lambda k: progress.advance(tasks[k]),
            cache_kwargs=_cache_kwargs(args),
        )
    print_tables(console, result)
    payload = {**result.to_json(), "versions": environment()}
    write_json(args.json, payload)
    if args.json:
        console.print(f"wrote {args.json}")
    if args.plot:
        plot_runs(result, args.plot)
        console.print(f"wrote {args.plot}")
    return 0


def _run_diffusers_wan(args: argparse.Namespace, kinds: tuple[str, ...], console) -> int:
    """``--model diffusers-wan``: the table and JSON of :mod:`streamkv_lab.experiments.diffusers_wan`."""
    from streamkv_lab.commands._common import write_json
    from streamkv_lab.env import environment
    from streamkv_lab.experiments.diffusers_wan import print_wan_tables, run_diffusers_wan

    with console.status("") as status:
        result = run_diffusers_wan(
            kinds, config=args.config, chunks=args.chunks, guidance=args.guidance, device=args.device,
            seed=args.seed, cache_kwargs=_cache_kwargs(args), progress=lambda k: status.update(f"running {k}"),
        )
    print_wan_tables(console, result)
    write_json(args.json, {**result.to_json(), "versions": environment()})
    if args.json:
        console.print(f"wrote {args.json}")
    return 0


def _cache_kwargs(args: argparse.Namespace) -> dict[str, dict]:
    """Extra constructor arguments per cache kind."""
    return {"mass": {"tau": args.tau}}


def _run_context_parallel(args: argparse.Namespace, kinds: tuple[str, ...], console, launcher: str = "spawn") -> int:
    """``--nproc N`` or torchrun: the rollouts on one process and on ``N`` ranks; parity and cache bytes."""
    from rich.table import Table

    from streamkv_lab.experiments.cp_compare import compare_context_parallel
    from streamkv_lab.commands._common import write_json
    from streamkv_lab.env import environment

    with console.status("") as status:
        result = compare_context_parallel(
            kinds, nproc=args.nproc, config=args.config, chunks=args.chunks, guidance=args.guidance,
            mode=args.mode, device=args.device, seed=args.seed, cache_kwargs=_cache_kwargs(args),
            progress=lambda what: status.update(f"running {what}"), launcher=launcher,
        )
    if result is None:  # a torchrun rank other than 0: rank 0 reports
        return 0
    n, cfg = result.world_size, result.config
    console.print(
        f"[bold]{cfg['name']}[/]: {cfg['heads']} heads over {n} ranks ({cfg['heads'] // n} per rank), "
        f"{cfg['device']}, mode {cfg['mode']}, guidance {cfg['guidance']}; streams of {cfg['streams']} chunks "
        f"(reset between); first eviction at chunk {cfg['first_eviction_chunk']}, ring wraps "
        f"{cfg['ring_wraps_first_stream']}x"
    )
    table = Table(title=f"Ulysses context parallelism: {n} ranks vs 1 process")
    for col in ("cache", "max |diff|", "scale", "|diff|/scale", "ranks agree", "cache B/rank", "cache B 1 proc"):
        table.add_column(col, justify="left" if col == "cache" else "right")
    for k in kinds:
        table.add_row(
            k, f"{result.max_abs_diff[k]:.2e}", f"{result.output_scale[k]:.3f}",
            f"{result.max_abs_diff[k] / result.output_scale[k]:.2e}", "yes" if result.ranks_agree[k] else "NO",
            f"{result.cache_bytes_per_rank[k]:,}", f"{result.cache_bytes_single[k]:,}",
        )
    console.print(table)
    for k in kinds:
        per, single = result.cache_bytes_per_rank[k], result.cache_bytes_single[k]
        console.print(
            f"{k}: each of the {n} ranks holds {per:,} cache bytes = {per / single:.4g} (1/{single / per:.4g}) of the "
            f"single-process {single:,}"
        )
    console.print("parity bound: |diff| / scale <= 1e-5 (fp32)")
    payload = {**result.to_json(), "versions": environment()}
    write_json(args.json, payload)
    if args.json:
        console.print(f"wrote {args.json}")
    return 0


def available_caches() -> tuple[str, ...]:
    """Every registered cache kind, the current path first."""
    from streamkv.caches import CACHE_KINDS

    rest = [k for k in CACHE_KINDS if k not in CACHES]
    return (*CACHES, *rest)
