"""The CLI as a careless or hostile user drives it (issue 18, item 6): every option is either
used or refused, every bound is checked before any work (no model built, no text read, no
stream run), counts are >= 1, and a bad file is one line on stderr with exit status 2, never a
traceback. Each refused case here ran vacuous or ignored work, or failed late, before the fix.
"""

from __future__ import annotations

import importlib

import pytest

from streamkv_lab.cli import SUBCOMMANDS, main

#: the functions where each command's work starts (patched: reaching one is "work started")
WORK = [
    "streamkv_lab.fuzz.run_fuzz", "streamkv_lab.experiments.certify.run_certify",
    "streamkv_lab.experiments.twotier.run_real", "streamkv_lab.smollm2.load_smollm2",
    "streamkv_lab.video.toy.load_model", "streamkv_lab.video.train.train",
    "streamkv_lab.experiments.rollout_compare.compare_rollouts",
    "streamkv_lab.experiments.diffusers_wan.run_diffusers_wan",
    "streamkv_lab.experiments.cp_compare.compare_context_parallel", "streamkv_lab.experiments.pareto.run_pareto",
    "streamkv_lab.budget.run_streaming_budget", "streamkv_lab.experiments.verify.run_verify",
    "streamkv_lab.bench.reads.measure_reads", "streamkv_lab.experiments.chart_error.load_stream",
]


class Reached(Exception):
    """The command got to its work (with these arguments)."""


@pytest.fixture
def no_work(monkeypatch):
    """Every command's run() and every work function raise: a refusal must come first."""
    def must_not_run(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    for module, _ in SUBCOMMANDS.values():
        monkeypatch.setattr(importlib.import_module(f"streamkv_lab.commands.{module}"), "run", must_not_run)
    for path in WORK:
        mod, name = path.rsplit(".", 1)
        monkeypatch.setattr(importlib.import_module(mod), name, must_not_run)


@pytest.fixture
def reach(monkeypatch):
    """Every work function raises :class:`Reached` with its arguments (the commands' run() is real)."""
    def reached(*args, **kwargs):
        raise Reached(args, kwargs)

    for path in WORK:
        mod, name = path.rsplit(".", 1)
        monkeypatch.setattr(importlib.import_module(mod), name, reached)


REFUSED = [
    # counts: a fuzz of 0 calls reported success having tested nothing
    ("fuzz --calls 0", "--calls must be >= 1, got 0"),
    ("fuzz --layouts 0", "--layouts must be >= 1, got 0"),
    ("fuzz --seed -1", "--seed must be >= 0, got -1"),
    ("verify --seed -1", "--seed must be >= 0, got -1"),
    ("train-toy --seed -1", "--seed must be >= 0, got -1"),  # numpy refused it inside the first batch
    ("rollout --seed 4294967296", "--seed must be < 2**32 (a 32-bit seed), got 4294967296"),
    # certify: the options of the other mode were ignored
    ("certify --real --cache h2o", "--cache: options of the certified rollouts, not of --real"),
    ("certify --real --recall --every 2", "--recall, --every: options of the certified rollouts"),
    ("certify --tokens 64", "--tokens: options of --real"),
    ("certify --perplexity", "--perplexity: options of --real"),
    ("certify --real --datasets video --lm-layers 2", "--lm-layers: apply to datasets (or --perplexity) this run"),
    ("certify --real --datasets smollm2 --video-frames 10", "--video-frames: apply to datasets"),
    ("certify --real --datasets smollm2 --toy-frames 10", "--toy-frames: apply to datasets"),
    ("certify --real --datasets toy --toy-frames 7", "--toy-frames must be a multiple of 2"),
    # certify --real: a stream whose quarter cannot hold two chunks failed in the library, a traceback
    ("certify --real --datasets video --video-frames 8", "--video-frames must be >= 9 (a quarter of the stream"),
    ("certify --real --datasets toy --toy-frames 22", "its context, and a quarter of the stream holding its sinks"),
    ("certify --real --tau 1.5", "--tau must be in the open interval (0, 1), got 1.5"),
    ("certify --real --perplexity --tokens 64", "must hold two chunks beyond the sinks and be < tokens (64)"),
    ("certify --recall-slots 5", "--recall-slots bounds the recall slots: it needs --recall"),
    ("certify --budget-tau 0.2", "--budget-tau is the mass cache's own budget: it needs --cache mass"),
    ("certify --sketch-bits 8 --box-dtype float32", "--box-dtype: options of the block boxes, which --sketch-bits"),
    ("certify --dit-chunks 33", "--dit-chunks must be <= 32 (the tiny DiT's RoPE horizon), got 33"),
    # lm-eval: its sink check was dead code after a return; the text's end was found after the model loaded
    ("lm-eval --sink -1", "--sink must be >= 0, got -1"),
    ("lm-eval --error-stride 0", "--error-stride must be >= 1, got 0"),
    ("lm-eval --offset 300000", "--offset 300000 + --tokens 16384 pass the end of the text (288962 tokens)"),
    ("lm-eval --kinds ring --taus 0.1", "--taus are the mass cache's: they need 'mass' in --kinds"),
    ("lm-eval --kinds ring,ring", "--kinds must name each kind once"),
    # lm-eval: an empty memory list ran the full cache alone; repeated values were merged silently
    ("lm-eval --memory=", "memory must be one or more distinct token counts, got ()"),
    ("lm-eval --memory 36,36", "memory must be one or more distinct token counts, got (36, 36)"),
    ("lm-eval --kinds ring,mass --taus 0.1,0.1", "taus must be distinct, got (0.1, 0.1)"),
    # video-eval: found after the model loaded and the full-history stream ran
    ("video-eval --tau 2", "--tau must be in the open interval (0, 1), got 2.0"),
    ("video-eval --frames 1000", "--frames must be <= 256 (the toy model's RoPE horizon), got 1000"),
    ("video-eval --weights /nonexistent.safetensors", "--weights /nonexistent.safetensors: no such file"),
    # train-toy: an odd window failed inside train(); a huge one would allocate its mask
    ("train-toy --frames 1", "--frames must be a multiple of the toy model's 2-frame chunk, at most its 256"),
    ("train-toy --frames 100000", "at most its 256-frame horizon, got 100000"),
    # rollout: found after the model was built, or after the stream ran to the horizon
    ("rollout --cache ring --compare", "--cache names the one cache run without --compare"),
    ("rollout --tau 0.2", "--tau is the mass cache's budget: it needs --cache mass or --compare"),
    ("rollout --cache mass --tau 2", "--tau must be in the open interval (0, 1), got 2.0"),
    ("rollout --cache lru", "--cache must be one of"),
    ("rollout --guidance nan", "--guidance must be a finite number >= 1"),
    ("rollout --config wan2.1-1.3b --cache lru", "--cache must be one of"),
    ("rollout --chunks 33", "--chunks must be <= 32 (the tiny model's RoPE horizon in chunks), got 33"),
    ("rollout --model diffusers-wan --chunks 200", "--chunks must be <= 128"),
    ("rollout --mode graph", "--mode graph captures CUDA graphs: it needs --device cuda"),
    ("rollout --nproc 3", "heads (4) must be divisible by the world size (3)"),
    ("budget --query-scale inf", "--query-scale must be a number in [0, 1e4]"),
    ("rollout --device tpu", "--device must be cpu or cuda (cuda:N), got 'tpu'"),
    ("bench --device meta", "--device must be cpu or cuda (cuda:N), got 'meta'"),
    # bench --read runs the read benchmark alone: the maintenance run's options did nothing
    ("bench --read --preset small", "--preset: of the maintenance benchmark; --read runs the read benchmark alone"),
    ("bench --read --no-scaling --scored", "--no-scaling, --scored: of the maintenance benchmark"),
    ("bench --read --modes eager,fast", "--modes must be a comma-separated subset of eager, compiled"),
    ("bench --modes eager", "--modes: options of --read"),
    ("bench --read-shape tiny-video", "--read-shape: options of --read"),
    ("bench --read-queries 1", "--read-queries: options of --read"),
    ("bench --read --modes eager --compile-backend eager", "--compile-backend: no compiled mode runs"),
    # chart: lists checked against the registries, options of what does not run refused
    ("chart --kinds ring,lru", "--kinds must be distinct names of full, ring"),
    ("chart --formats int3", "--formats must be distinct names of"),
    ("chart --kinds ring,tova", "--kinds must include full: every time is given as a ratio to the full cache's"),
    ("chart --formats int8,int4", "--formats must include bf16"),
    ("chart --budgets tokens:2", "--budgets: a budget is tokens:F or bytes:F with 0 < F < 1"),
    ("chart --modes eager --compile-backend eager", "--compile-backend: no compiled mode runs"),
    ("chart --shape smollm2-decode --frames 16", "--frames: the toy model's stream gives the video shapes' errors"),
    ("chart --shape self-forcing --lm-tokens 64", "--lm-tokens: SmolLM2's stream gives the LM shapes' errors"),
    ("chart --shape tiny-video --frames 7", "--frames must be a multiple of the toy model's 2-frame chunk"),
    ("chart --shape tiny-decode --lm-layers 30", "--lm-layers must be distinct layers of SmolLM2's 30"),
    ("chart --shape tiny-decode --lm-tokens 16 --lm-chunk 16", "--lm-tokens must hold two --lm-chunk spans"),
    ("chart --layers 0", "--layers must be >= 1, got 0"),
    ("chart --repeats 0", "--repeats must be >= 1, got 0"),
]


@pytest.mark.parametrize("argv, message", REFUSED, ids=[a for a, _ in REFUSED])
def test_bad_options_are_refused_before_any_work(no_work, capsys, argv, message):
    assert main(argv.split()) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("argv", ["budget --syn-taus 0.1,1.5", "fork --memory --preset huge", "chart --shape nowhere",
                                  "nosuch", ""])
def test_argparse_refusals_are_one_line_too(no_work, capsys, argv):
    """Refusals argparse makes itself (a value its type refuses, an invalid choice, a missing
    command) printed the usage text before the error: one line now, exit status 2, as every
    other usage error."""
    with pytest.raises(SystemExit) as exc:
        main(argv.split())
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ": error: " in err and "--help)" in err and "usage:" not in err, err


def test_a_weights_file_that_is_not_safetensors_is_one_line_not_a_traceback(no_work, tmp_path, capsys):
    """video-eval --weights of another format ended in safetensors' SafetensorError traceback."""
    bad = tmp_path / "toy.safetensors"
    bad.write_bytes(b"\x00" * 64)
    assert main(["video-eval", "--weights", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"--weights {bad}: not a readable safetensors file" in err and err.count("\n") == 1, err


def test_weights_trained_within_the_context_are_refused_by_video_eval(no_work, tmp_path, capsys):
    """Weights of a training window within the context frames left video-eval no generated frame
    inside the horizon: it wrote NaN into its JSON and exited 0."""
    import json

    import torch
    from safetensors.torch import save_file

    from streamkv_lab.video.config import CONTEXT_FRAMES

    for frames, rc in ((CONTEXT_FRAMES, 2), (CONTEXT_FRAMES + 2, None)):
        w = tmp_path / f"toy{frames}.safetensors"
        save_file({"x": torch.zeros(1)}, str(w), metadata={"streamkv": json.dumps({"frames": frames})})
        if rc is None:  # one chunk past the context: the checks pass it on to the work
            with pytest.raises(AssertionError, match="work started"):
                main(["video-eval", "--weights", str(w)])
            continue
        assert main(["video-eval", "--weights", str(w)]) == rc
        err = capsys.readouterr().err
        assert f"trained on {frames}-frame windows, within the {CONTEXT_FRAMES} context frames" in err, err
        assert err.count("\n") == 1


VALID = [  # each reaches its work: the checks refuse nothing the commands can run
    "fuzz --calls 1 --layouts 1", "verify", "pareto", "budget", "certify", "certify --pool-events 0",
    "certify --cache mass --budget-tau 0.2", "certify --recall --recall-slots 5", "certify --sketch-bits 8",
    "certify --real", "certify --real --datasets video --video-frames 9 --seed 1",
    "lm-eval --quick --kinds ring,mass --taus 0.1", "video-eval", "train-toy --frames 16",
    "rollout", "rollout --compare --tau 0.1", "rollout --cache mass --tau 0.1", "rollout --model diffusers-wan",
    "bench --read", "bench --read --read-queries 1", "bench --read --read-shape tiny-decode --modes compiled --compile-backend eager",
    "chart",
    "chart --shape tiny-video --kinds full,tova,tier --formats bf16,int8 --budgets bytes:1/3 --modes compiled",
]


@pytest.mark.parametrize("argv", VALID)
def test_valid_options_reach_the_work(reach, argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the commands' default output paths
    with pytest.raises(Reached):
        main(argv.split())


def test_the_options_given_are_told_apart_from_defaults():
    """``args._given`` (what a command may refuse when it does not apply) for plain, boolean,
    appended and default-valued options."""
    from streamkv_lab.cli import build_parser, given_options

    parser = build_parser()
    argv = ["bench", "--preset", "krea-realtime-14b", "--preset", "self-forcing", "--no-scaling", "--device", "cpu"]
    assert given_options(parser, argv) == {"preset", "no_scaling", "device"}
    assert given_options(parser, ["certify", "--tau", "0.1"]) == {"tau"}  # the default value, given
    assert given_options(parser, ["certify"]) == set()


@pytest.mark.parametrize("tau, expected", [(None, 0.05), ("0.2", 0.2)])
def test_certify_real_uses_tau(reach, tau, expected):
    """certify --real ran its committed configurations at tau 0.05 whatever --tau said."""
    argv = ["certify", "--real", "--datasets", "video"] + ([] if tau is None else ["--tau", tau])
    with pytest.raises(Reached) as info:
        main(argv)
    _, kwargs = info.value.args
    configs = kwargs["configs"]["video"]
    assert configs and all(c.tau == expected for c in configs)
