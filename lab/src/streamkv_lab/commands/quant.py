"""``streamkv quant``: quantised KV storage measured against the peers in one run, on real
weights (SmolLM2-135M on Moby-Dick; the trained toy video model), JSON + plot."""

from __future__ import annotations

import argparse

EPILOG = """\
What runs:
  read     one read at --read-tokens cached tokens (SmolLM2's layer geometry, a chunk of
           queries): transient bytes and ms of streamkv's block-by-block read in each format, a
           dense bf16 / fp32 ring, transformers' QuantizedCache (quanto / HQQ) and sglang's
           QVGPackedCausalKVCache (a stand-in codec for its CUDA-only PRQ kernels)
  smollm2  --tokens tokens streamed in spans of --chunk through every layer's cache
           (streamkv_lab.experiments.quant_lm): the ring at the full segment in every format,
           transformers' QuantizedCache at the same bits and residual (--residual), at a
           quarter of the bf16 full cache's device bytes the bf16 ring / mass / H2O / TOVA and
           the int8 / int4 ring and TOVA at the same bytes; certificates (Certifier + float64
           full-history check) of the ring at the quarter bytes in bf16 / int8 / int4
  video    the toy video model (--clips held-out clips of --frames frames): the same caches,
           error against the float32 full-history rollout
JSON rows per (dataset, cache, bits): bytes_per_token (codes + scales), device_bytes,
transient_bytes, error_mean, error_p99, perplexity, certificate_violations, tightness_median,
ms_per_chunk; then "targets" (each issue target, met or not, with its numbers).
"""


#: the sizes --quick sets where the option is not given (explicit options win), and the defaults
QUICK = {"tokens": 512, "clips": 1, "frames": 16, "read_tokens": 1024, "cert_tokens": 512}
DEFAULTS = {"tokens": 2048, "clips": 2, "frames": 32, "read_tokens": 4096, "cert_tokens": 1024}
#: the parts (``--skip``): the options each one alone uses; peers and certificates are parts of smollm2
PARTS = {"read": ("read_tokens",), "smollm2": ("tokens", "residual", "error_stride"),
         "peers": (), "certificates": ("cert_tokens",), "video": ("clips", "frames")}
SINK = 4  # the SmolLM2 caches' sinks (run_lm's and the read benchmark's)
CONTEXT = 8192  # SmolLM2's trained context


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    q = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in QUICK.items())
    p.add_argument("--tokens", type=int, default=None,
                   help=f"SmolLM2 tokens (one segment; default {DEFAULTS['tokens']})")
    p.add_argument("--chunk", type=int, default=64, help="span / cache chunk in tokens (default 64)")
    p.add_argument("--residual", type=int, default=128,
                   help="full-precision tokens of transformers' QuantizedCache, and ours (open span included)")
    p.add_argument("--cert-tokens", type=int, default=None,
                   help=f"tokens of the certified runs (default {DEFAULTS['cert_tokens']})")
    p.add_argument("--error-stride", type=int, default=16, help="attention error at every k-th position")
    p.add_argument("--read-tokens", type=int, default=None,
                   help=f"cached tokens of the read benchmark (default {DEFAULTS['read_tokens']})")
    p.add_argument("--clips", type=int, default=None, help=f"toy video clips (default {DEFAULTS['clips']})")
    p.add_argument("--frames", type=int, default=None, help=f"frames per toy clip (default {DEFAULTS['frames']})")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: read, smollm2, peers, video, certificates")
    p.add_argument("--quick", action="store_true", help=f"a smoke run: {q} (explicit options win)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--json", default="out/quant.json", help="result JSON (default out/quant.json)")
    p.add_argument("--plot", default="out/quant.png", help="plot PNG (default out/quant.png)")


def sizes(args: argparse.Namespace) -> dict[str, int]:
    """The sizes of the run: each option given, else ``--quick``'s, else the default."""
    preset = QUICK if args.quick else DEFAULTS
    return {name: getattr(args, name) if getattr(args, name) is not None else preset[name] for name in DEFAULTS}


def skipped(args: argparse.Namespace) -> set[str]:
    """The parts ``--skip`` names (checked)."""
    from streamkv_lab.errors import UsageError

    names = [s.strip() for s in args.skip.split(",") if s.strip()]
    bad = sorted(set(names) - set(PARTS))
    if bad or len(set(names)) != len(names):
        raise UsageError(f"--skip takes read, smollm2, peers, video, certificates (each once); got {args.skip!r}")
    return set(names)


def check(args: argparse.Namespace) -> None:
    """Every bound before any work (:class:`~streamkv_lab.errors.UsageError`): the parts to skip
    (not all of them; an option only a skipped part uses is refused), the sizes of the parts that
    run against each other (chunk, residual, SmolLM2's context, the caches' minimum windows), the
    toy model's horizon and weights."""
    from streamkv_lab.commands._common import toy_weights_horizon
    from streamkv_lab.errors import UsageError
    from streamkv_lab.video.config import CONTEXT_FRAMES
    from streamkv.models.config import get_config

    skip = skipped(args)
    given = getattr(args, "_given", set())
    if {"read", "smollm2", "video"} <= skip:
        raise UsageError(f"--skip {args.skip}: skips every part (read, smollm2, video); nothing would run")
    within = sorted(skip & {"peers", "certificates"}) if "smollm2" in skip else []
    if within:
        raise UsageError(f"--skip {','.join(within)}: part of smollm2, which --skip already skips (leave it out)")
    running = {"smollm2", "read", "video"} - skip
    if "smollm2" in running:
        running |= {"peers", "certificates"} - skip
    unused = [n for n in dict.fromkeys(o for part, opts in PARTS.items() for o in opts)
              if n in given and not any(n in PARTS[part] for part in running)]
    if "chunk" in given and not {"read", "smollm2"} & running:
        unused.append("chunk")
    if unused:
        it = "it" if len(unused) == 1 else "them"
        raise UsageError(f"{', '.join('--' + n.replace('_', '-') for n in unused)}: only parts this run skips (--skip "
                         f"{args.skip}) use {it}; leave {it} out")
    sz, chunk = sizes(args), args.chunk
    if "read" in running and (sz["read_tokens"] % chunk or sz["read_tokens"] < chunk + SINK):
        raise UsageError(f"--read-tokens must be a multiple of --chunk ({chunk}) and >= chunk + {SINK} sinks, got "
                         f"{sz['read_tokens']}")
    if "smollm2" in running:
        if sz["tokens"] % chunk or not chunk + SINK <= sz["tokens"] <= CONTEXT:
            raise UsageError(f"--tokens must be a multiple of --chunk ({chunk}), >= chunk + {SINK} sinks and <= "
                             f"{CONTEXT} (SmolLM2's trained context), got {sz['tokens']}")
        if args.residual <= chunk:
            raise UsageError(f"--residual ({args.residual}) must be above --chunk ({chunk}): it includes the open span")
        if "certificates" in running and sz["cert_tokens"] // 2 < chunk + SINK:
            raise UsageError(f"--cert-tokens must be >= {2 * (chunk + SINK)}: the certified ring holds half of them, "
                             f"at least {SINK} sinks and a chunk of {chunk}; got {sz['cert_tokens']}")
    if "video" in running:
        top = get_config("toy").max_frames
        if sz["frames"] % 2 or not CONTEXT_FRAMES < sz["frames"] <= top:
            raise UsageError(f"--frames must be even, > {CONTEXT_FRAMES} (the context frames) and <= {top} (the toy "
                             f"model's RoPE horizon), got {sz['frames']}")
        toy_weights_horizon(None, flag="the toy video model's weights")


def run(args: argparse.Namespace) -> int:
    import os
    import shlex
    import sys
    import time

    import torch

    from streamkv_lab.commands._common import write_json
    from streamkv_lab.env import environment, threads
    from streamkv_lab.experiments.quant_report import plot_quant, print_quant, targets

    check(args)
    skip, sz = skipped(args), sizes(args)
    t0 = time.perf_counter()
    os.environ.setdefault("TQDM_DISABLE", "1")
    log = lambda s: print(f"{time.perf_counter() - t0:7.0f} s  {s}", flush=True)  # noqa: E731
    doc: dict = {"config": {**sz, "chunk": args.chunk, "residual": args.residual, "error_stride": args.error_stride,
                            "skip": sorted(skip), "quick": args.quick}, "rows": []}
    with threads(args.threads):
        if "read" not in skip:
            from streamkv_lab.experiments.quant_read import describe, read_costs

            log("read benchmark")
            doc["read"] = read_costs(tokens=sz["read_tokens"], chunk=args.chunk)
            print("\n".join(describe(doc["read"])), flush=True)
        if "smollm2" not in skip:
            from transformers.utils import logging

            from streamkv_lab.experiments.quant_lm import run_lm
            from streamkv_lab.smollm2 import SMOLLM2, load_smollm2, text_tokens
            from streamkv_lab.texts import moby_dick

            logging.disable_progress_bar()
            model, tok = load_smollm2()
            ids = text_tokens(tok, moby_dick(), sz["tokens"])
            with torch.no_grad():
                lm = run_lm(model, ids, chunk=args.chunk, residual=args.residual, error_stride=args.error_stride,
                            cert_tokens=sz["cert_tokens"], peers="peers" not in skip,
                            certificates="certificates" not in skip, progress=log)
            doc["smollm2"] = {k: v for k, v in lm.items() if k != "rows"} | {"model": SMOLLM2}
            doc["rows"] += lm["rows"]
        if "video" not in skip:
            from streamkv_lab.experiments.quant_video import run_video

            vid = run_video(clips=sz["clips"], frames=sz["frames"], progress=log)
            doc["video"] = {k: v for k, v in vid.items() if k != "rows"}
            doc["rows"] += vid["rows"]
    doc["targets"] = targets(doc)
    doc["wall_s"] = time.perf_counter() - t0
    doc["command"] = "streamkv " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["quant"] else (
        "streamkv quant (from Python)")
    doc["versions"] = environment(torch.device("cpu"))
    print_quant(doc)
    write_json(args.json, doc)
    plot_quant(doc, args.plot)
    print(f"wall {doc['wall_s']:.0f} s; wrote {args.json} and {args.plot}")
    return 0
