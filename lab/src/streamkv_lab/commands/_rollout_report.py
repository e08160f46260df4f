"""Tables, progress bars and plots for rollout comparisons (CLI only)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from streamkv_lab.plotting import pyplot, save


@contextmanager
def progress_bar(console: Console) -> Iterator[Progress]:
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=False,
    ) as progress:
        yield progress


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f}"


def print_tables(console: Console, result) -> None:
    cfg = result.config
    console.print(
        f"[bold]{cfg['name']}[/]: {cfg['layers']} layers, dim {cfg['dim']}, {cfg['heads']} heads; "
        f"{cfg['frames_per_chunk']}-frame chunks of {cfg['frames_per_chunk'] * (cfg['latent_h'] // cfg['patch']) * (cfg['latent_w'] // cfg['patch'])} tokens, "
        f"sink {cfg['sink_frames']} frame(s), window {cfg['window_frames']} frames; guidance {cfg['guidance']}, "
        f"mode {cfg['mode']}, {cfg['device']}; streams of {cfg['streams']} chunks (reset between); "
        f"first eviction at chunk {cfg['first_eviction_chunk']}, ring wraps {cfg['ring_wraps_first_stream']}x"
    )
    table = Table(title="per cache (medians over the steady chunks: those that evict)")
    cols = ("cache", "chunk ms", "maint. ms/fwd", "maint. share", "peak MiB", "cache MiB", "max |diff|", "kind")
    for col in cols:
        table.add_column(col, justify="left" if col in ("cache", "kind") else "right", no_wrap=col in ("cache", "kind"))
    first = next(iter(result.runs))
    forwards = len(cfg["timesteps"]) + 1
    branches = 2 if cfg["guidance"] > 1 else 1
    for name, run in result.runs.items():
        lat = run.steady_median(run.chunk_latency_ms)
        maint = run.steady_median(run.maintenance_ms)
        share = maint * forwards * branches / lat if lat else float("nan")
        diff = "reference" if name == first else f"{result.max_abs_diff[name]:.2e}"
        if run.retains_window:
            kind = "exact (window)"
        else:
            knob = f"tau {run.extra['tau']}" if "tau" in run.extra else f"budget {run.extra.get('budget')}"
            kind = f"lossy ({knob}; {run.extra.get('overflow_total', 0)} overflows)"
        table.add_row(name, f"{lat:.2f}", f"{maint:.4f}", f"{share:.2%}", _mb(run.peak_bytes), _mb(run.cache_bytes),
                      diff, kind)
    console.print(table)
    exact = [k for k, r in result.runs.items() if r.retains_window and k in result.max_abs_diff]
    if exact:
        worst = max(result.max_abs_diff[k] for k in exact)
        ok = worst <= 1e-5 * result.output_scale
        console.print(
            f"parity of {', '.join(exact)} with {first}: max |diff| / output scale {result.output_scale:.3f} = "
            f"{worst / result.output_scale:.2e} (bound 1e-5: {'holds' if ok else 'VIOLATED'})"
        )
    lossy = [k for k, r in result.runs.items() if not r.retains_window]
    if lossy:
        console.print(
            "budgeted caches keep other tokens than the window by design; their |diff| is their approximation "
            "error on this randomly initialised model (see `streamkv budget` for error vs memory)"
        )


def plot_runs(result, path: str) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in result.runs.items():
        x = range(len(run.chunk_latency_ms))
        ax1.plot(x, run.chunk_latency_ms, marker="o", label=name)
        ax2.plot(x, [m * 1e3 for m in run.maintenance_ms], marker="o", label=name)
    cfg = result.config
    split = cfg["streams"][0]
    for ax in (ax1, ax2):
        ax.axvline(split - 0.5, color="grey", ls=":", lw=1)
        ax.axvline(cfg["first_eviction_chunk"] - 0.5, color="red", ls="--", lw=0.8)
        ax.set_xlabel("chunk (dotted: reset to the 2nd prompt; dashed: first eviction)")
        ax.legend()
    ax1.set_ylabel("chunk latency (ms)")
    ax2.set_ylabel("cache maintenance per forward (µs)")
    ax1.set_title("per-chunk latency")
    ax2.set_title("cache maintenance (all layers, per DiT forward)")
    fig.suptitle(f"{cfg['name']} streaming rollout, guidance {cfg['guidance']}, {cfg['mode']} on {cfg['device']}")
    save(fig, path, dpi=110)
