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
           (streamkv.lab.experiments.quant_lm): the ring at the full segment in every format,
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument("--tokens", type=int, default=2048, help="SmolLM2 tokens (one segment; default 2048)")
    p.add_argument("--chunk", type=int, default=64, help="span / cache chunk in tokens (default 64)")
    p.add_argument("--residual", type=int, default=128,
                   help="full-precision tokens of transformers' QuantizedCache, and ours (open span included)")
    p.add_argument("--cert-tokens", type=int, default=1024, help="tokens of the certified runs (default 1024)")
    p.add_argument("--error-stride", type=int, default=16, help="attention error at every k-th position")
    p.add_argument("--read-tokens", type=int, default=4096, help="cached tokens of the read benchmark")
    p.add_argument("--clips", type=int, default=2, help="toy video clips (default 2)")
    p.add_argument("--frames", type=int, default=32, help="frames per toy clip (default 32)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: read, smollm2, peers, video, certificates")
    p.add_argument("--quick", action="store_true", help="a smoke run: 512 tokens, 1 clip of 16 frames, 1024-token read")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--json", default="out/quant.json", help="result JSON (default out/quant.json)")
    p.add_argument("--plot", default="out/quant.png", help="plot PNG (default out/quant.png)")


def run(args: argparse.Namespace) -> int:
    import os
    import shlex
    import sys
    import time

    import torch

    from streamkv.lab.commands._common import write_json
    from streamkv.lab.env import environment, threads
    from streamkv.lab.experiments.quant_report import plot_quant, print_quant, targets

    skip = {s for s in args.skip.split(",") if s}
    bad = skip - {"read", "smollm2", "peers", "video", "certificates"}
    if bad:
        raise ValueError(f"--skip takes read, smollm2, peers, video, certificates; got {sorted(bad)}")
    if args.quick:
        args.tokens, args.clips, args.frames, args.read_tokens, args.cert_tokens = 512, 1, 16, 1024, 512
    for name in ("tokens", "chunk", "clips", "frames", "read_tokens", "cert_tokens", "error_stride"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.tokens % args.chunk or args.residual <= args.chunk:
        raise ValueError(f"--tokens ({args.tokens}) must be a multiple of --chunk ({args.chunk}) and --residual "
                         f"({args.residual}) above it")
    t0 = time.perf_counter()
    os.environ.setdefault("TQDM_DISABLE", "1")
    log = lambda s: print(f"{time.perf_counter() - t0:7.0f} s  {s}", flush=True)  # noqa: E731
    doc: dict = {"rows": []}
    with threads(args.threads):
        if "read" not in skip:
            from streamkv.lab.experiments.quant_read import describe, read_costs

            log("read benchmark")
            doc["read"] = read_costs(tokens=args.read_tokens, chunk=args.chunk)
            print("\n".join(describe(doc["read"])), flush=True)
        if "smollm2" not in skip:
            from transformers.utils import logging

            from streamkv.lab.experiments.quant_lm import run_lm
            from streamkv.lab.smollm2 import SMOLLM2, load_smollm2, text_tokens
            from streamkv.lab.texts import moby_dick

            logging.disable_progress_bar()
            model, tok = load_smollm2()
            ids = text_tokens(tok, moby_dick(), args.tokens)
            with torch.no_grad():
                lm = run_lm(model, ids, chunk=args.chunk, residual=args.residual, error_stride=args.error_stride,
                            cert_tokens=args.cert_tokens, peers="peers" not in skip,
                            certificates="certificates" not in skip, progress=log)
            doc["smollm2"] = {k: v for k, v in lm.items() if k != "rows"} | {"model": SMOLLM2}
            doc["rows"] += lm["rows"]
        if "video" not in skip:
            from streamkv.lab.experiments.quant_video import run_video

            vid = run_video(clips=args.clips, frames=args.frames, progress=log)
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
