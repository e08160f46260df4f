"""The CLI: instant --help (no torch import); a usage error is one line on stderr and exit status
2, before any work; anything else is a bug: its traceback and exit status 1; every option takes
effect or is refused."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from streamkv_lab.cli import SUBCOMMANDS, build_parser, main
from streamkv_lab.errors import UsageError, usage_errors


def test_help_does_not_import_torch():
    code = "import sys, streamkv_lab.cli; streamkv_lab.cli.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_errors_go_to_stderr_with_exit_status_2(capsys):
    from streamkv_lab.cli import main

    assert main(["rollout", "--config", "huge"]) == 2
    err = capsys.readouterr().err
    assert "streamkv rollout: error: unknown model config 'huge'" in err


def test_bad_arguments_fail_before_any_work(tmp_path, capsys, monkeypatch):
    """Counts, output paths and devices are checked before the run (no 25-94 s of work first):
    the command's run() is never entered."""
    import importlib

    from streamkv_lab.cli import SUBCOMMANDS, main

    def must_not_run(args):
        raise AssertionError(f"{args.command} started before its arguments were checked")

    for module, _ in SUBCOMMANDS.values():
        monkeypatch.setattr(importlib.import_module(f"streamkv_lab.commands.{module}"), "run", must_not_run)

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    cases = [
        (["rollout", "--chunks", "0"], "--chunks must be >= 1, got 0"),
        (["rollout", "--chunks", "-3"], "--chunks must be >= 1, got -3"),
        (["certify", "--dit-chunks", "0"], "--dit-chunks must be >= 1, got 0"),
        (["rollout", "--json", str(blocker / "r.json")], "cannot write there"),
        (["pareto", "--plot", str(tmp_path)], "is a folder, expected a file"),
        (["demo", "--out", str(blocker)], "is a file, expected a folder"),
        (["bench", "--threads", "0"], "--threads must be >= 1, got 0"),
        # found by a hostile battery: each ran (the whole experiment, or to a segfault) first
        (["bench", "--threads", "100000"], "--threads must be <= 256, got 100000"),
        (["pareto", "--plot", str(tmp_path / "p.txt")], "the file's suffix names its format"),
        (["budget", "--plot", str(tmp_path / "p")], "the file's suffix names its format"),
        (["fork", "--branches", "1000000"], "--branches must be <= 16, got 1000000"),
        (["budget", "--query-scale", "1e308"], "--query-scale must be a number in [0, 1e4]"),
    ]
    if Path("/proc/self").is_dir():  # os.access says yes there to root; creating a file fails (ran, then a traceback)
        cases += [(["fuzz", "--json", "/proc/streamkv.json"], "cannot write there"),
                  (["demo", "--out", "/proc/streamkv"], "cannot write there")]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)


def test_cuda_on_a_cpu_only_machine_is_one_clear_line(capsys):
    import pytest
    import torch

    from streamkv_lab.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: there is nothing to refuse")
    assert main(["rollout", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "has no CUDA device; use --device cpu" in err and "Traceback" not in err


# ------------------------------------------------------------------ usage errors vs bugs


class Reached(Exception):
    """The command got past its checks to this work function (with these arguments)."""


@pytest.fixture
def no_run(monkeypatch):
    """Every command's run() fails the test: a refusal must come before it."""
    def must_not_run(args):
        raise AssertionError(f"{args.command} started before its arguments were checked")

    for module, _ in SUBCOMMANDS.values():
        monkeypatch.setattr(importlib.import_module(f"streamkv_lab.commands.{module}"), "run", must_not_run)


def refused(argv: list[str], capsys) -> str:
    """The one line a refused command prints (exit status 2, no traceback)."""
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"streamkv {argv[0]}: error: "), err
    return err


USAGE = [  # each of these ran vacuous work, ignored an option or failed late before
    (["fuzz", "--positions", "-3"], "--positions must be >= 0, got -3"),
    (["fuzz", "--quant", "-1"], "--quant must be >= 0, got -1"),
    (["positions", "--quick", "--long-factor", "1"], "--long-factor must be >= 2"),
    (["positions", "--long-factor", "17"], "passes the toy model's 256-frame RoPE horizon: at most 16"),
    (["positions", "--quick", "--no-smollm2"], "--quick already runs StreamingLLM on a tiny Llama"),
    (["quant", "--skip", "read,smollm2,video"], "skips every part (read, smollm2, video); nothing would run"),
    (["quant", "--skip", "video", "--clips", "3"], "--clips: only parts this run skips (--skip video) use it"),
    (["quant", "--skip", "smollm2", "--tokens", "64", "--residual", "80"], "--tokens, --residual: only parts this"),
    (["quant", "--skip", "read,smollm2", "--chunk", "32"], "--chunk: only parts this run skips"),
    (["quant", "--skip", "certificates", "--cert-tokens", "512"], "--cert-tokens: only parts this run skips"),
    (["quant", "--skip", "smollm2,peers"], "--skip peers: part of smollm2, which --skip already skips"),
    (["quant", "--skip", "reed"], "--skip takes read, smollm2, peers, video, certificates"),
    (["quant", "--quick", "--tokens", "100"], "--tokens must be a multiple of --chunk (64)"),
    (["quant", "--tokens", "16384"], "<= 8192 (SmolLM2's trained context)"),
    (["quant", "--cert-tokens", "100"], "--cert-tokens must be >= 136"),
    (["quant", "--frames", "7"], "--frames must be even"),
    (["certify", "--real", "--lm-chunk", "512"], "--lm-chunk 512 does not fit the SmolLM2 two-tier budget"),
    (["certify", "--real", "--lm-chunk", "32"], "must hold the newest chunk and the next chunk"),
    (["certify", "--cache", "lru"], "--cache must be one of"),
    (["demo", "--tokens", "100"], "--tokens must be a multiple of 16 (the prefill chunk) in [128, 8192]"),
    (["demo", "--chunks", "40"], "--chunks must be in [1, 32] (the tiny model's RoPE horizon in chunks), got 40"),
    (["demo", "--headline-repeats", "0"], "--headline-repeats must be >= 1, got 0"),
    (["demo", "--weights", "/nonexistent.safetensors"], "--weights /nonexistent.safetensors: no such file"),
    (["video-eval", "--position-factor", "4", "--position-clips", "0"], "--position-clips 0 runs none"),
    (["video-eval", "--position-factor", "1"], "--position-factor must be >= 2"),
    (["video-eval", "--capacities", "4"], "--capacities 4: mass at 4 frames leaves a window of 2 frames"),
    (["bench", "--no-scaling", "--plot", "x.png"], "--plot: of a section this run skips"),
    (["bench", "--no-scaling", "--scaling-repeats", "2"], "--scaling-repeats: of a section this run skips"),
    (["bench", "--no-counts", "--no-compiled-counts"], "--no-compiled-counts: of a section this run skips"),
    (["lm-eval", "--kinds", "ring,lru"], "kinds must be among"),
    (["lm-eval", "--segment", "1"], "--segment must be >= 2, got 1"),
    (["rollout", "--config", "huge"], "unknown model config 'huge'"),
    (["train-toy", "--lr", "2"], "--lr must be in the open interval (0, 1), got 2.0"),
]


@pytest.mark.parametrize("argv, message", USAGE, ids=[" ".join(a) for a, _ in USAGE])
def test_a_usage_error_is_one_line_and_exit_status_2_before_any_work(no_run, tmp_path, monkeypatch, capsys, argv,
                                                                      message):
    monkeypatch.chdir(tmp_path)
    assert message in refused(argv, capsys)


def _options():
    """(subcommand, option string, type) of every option that takes a number."""
    import argparse

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        for a in parser._actions:
            if a.option_strings and a.type in (int, float) and not a.choices:
                yield name, a.option_strings[-1], a.type


NUMBERS = list(_options())


@pytest.mark.parametrize("command, option, kind", NUMBERS, ids=[f"{c} {o}" for c, o, _ in NUMBERS])
def test_every_number_option_refuses_a_negative_or_nan_value_before_work(no_run, tmp_path, monkeypatch, capsys,
                                                                         command, option, kind):
    """-1 for a count (every count is >= 0), nan for a real number: one line, exit status 2."""
    monkeypatch.chdir(tmp_path)
    value = "-1" if kind is int else "nan"
    err = refused([command, option, value], capsys)
    assert option in err, err


def test_number_options_were_found():
    assert ("fuzz", "--positions", int) in NUMBERS and ("fuzz", "--quant", int) in NUMBERS
    assert ("rollout", "--guidance", float) in NUMBERS and len(NUMBERS) > 50


def test_a_bug_is_a_traceback_and_exit_status_1(tmp_path):
    """An exception that is not a usage error (here a KeyError from run()) is not disguised as the
    user's mistake: the interpreter prints its traceback, the exit status is 1."""
    code = ("import sys\nimport streamkv_lab.commands.verify as verify\n"
            "def run(args):\n    return {}['no such key']\n"
            "verify.run = run\nfrom streamkv_lab.cli import main\nsys.exit(main(['verify']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 1, proc
    assert "Traceback (most recent call last)" in proc.stderr and "KeyError: 'no such key'" in proc.stderr
    assert "streamkv verify: error" not in proc.stderr


@pytest.mark.parametrize("exc", [ValueError("a library's own check"), TypeError("'NoneType' object is not iterable"),
                                 RuntimeError("x"), OSError("y"), KeyError("z")])
def test_only_a_usage_error_is_exit_status_2(monkeypatch, exc):
    """main() lets every other exception through (ValueError and TypeError too: the lm-eval bug
    was a TypeError printed as a user error)."""
    import streamkv_lab.commands.verify as verify

    def run(args):
        raise exc

    monkeypatch.setattr(verify, "run", run)
    with pytest.raises(type(exc)):
        main(["verify"])
    monkeypatch.setattr(verify, "run", lambda args: (_ for _ in ()).throw(UsageError("bad value")))
    assert main(["verify"]) == 2


def test_a_bug_inside_a_check_is_not_a_usage_error(monkeypatch):
    """A check that itself fails (lm-eval's default kinds read while still None) is a traceback."""
    from streamkv_lab.experiments.lm_config import LMEvalConfig

    def broken(self):
        raise TypeError("'NoneType' object is not iterable")

    monkeypatch.setattr(LMEvalConfig, "run_kinds", broken)
    with pytest.raises(TypeError):
        main(["lm-eval", "--quick"])


def test_usage_errors_converts_only_what_it_wraps():
    with pytest.raises(UsageError, match="^--tau: tau must be in"):
        with usage_errors(what="--tau"):
            raise ValueError("tau must be in (0, 1)")
    with pytest.raises(KeyError):
        with usage_errors():
            raise KeyError("a bug")
    with pytest.raises(TypeError):
        with usage_errors():  # ValueError only, unless TypeError is named
            raise TypeError("a bug")
    assert issubclass(UsageError, ValueError)


def test_a_missing_optional_dependency_names_its_extra(monkeypatch, capsys):
    import streamkv_lab.commands.verify as verify

    def run(args):
        raise ModuleNotFoundError("No module named 'transformers'", name="transformers")

    monkeypatch.setattr(verify, "run", run)
    assert main(["verify"]) == 2
    assert "needs transformers: pip install 'streamkv[gguf]'" in capsys.readouterr().err

    def run_other(args):
        raise ModuleNotFoundError("No module named 'orjson'", name="orjson")  # not ours to name: a traceback

    monkeypatch.setattr(verify, "run", run_other)
    with pytest.raises(ModuleNotFoundError):
        main(["verify"])


# ------------------------------------------------------------ every option takes effect
@pytest.fixture
def reach(monkeypatch):
    """The work functions raise :class:`Reached` with their arguments (the commands' run() is real)."""
    def reached(*args, **kwargs):
        raise Reached(args, kwargs)

    for path in ("streamkv_lab.experiments.positions.run_positions", "streamkv_lab.smollm2.load_smollm2",
                 "streamkv_lab.fuzz.run_fuzz", "streamkv_lab.experiments.quant_read.read_costs"):
        mod, name = path.rsplit(".", 1)
        monkeypatch.setattr(importlib.import_module(mod), name, reached)


@pytest.mark.parametrize("argv, factor", [(["positions", "--quick", "--long-factor", "5"], 5),
                                          (["positions", "--quick"], 2), (["positions"], 8),
                                          (["positions", "--long-factor", "3"], 3)])
def test_positions_long_factor_is_honoured_with_quick(reach, tmp_path, monkeypatch, argv, factor):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Reached) as info:
        main(argv)
    assert info.value.args[1]["long_factor"] == factor and info.value.args[1]["quick"] == ("--quick" in argv)


@pytest.mark.parametrize("argv, tokens, read", [(["quant", "--quick", "--tokens", "128"], 128, 1024),
                                                (["quant", "--quick"], 512, 1024), (["quant"], 2048, 4096),
                                                (["quant", "--quick", "--read-tokens", "128"], 512, 128)])
def test_quant_sizes_given_win_over_quick(reach, tmp_path, monkeypatch, argv, tokens, read):
    """--quick fills the sizes not given; a size given takes effect (it was overwritten)."""
    import argparse

    from streamkv_lab.commands import quant

    monkeypatch.chdir(tmp_path)
    with pytest.raises(Reached) as info:  # the read benchmark: the first part
        main(argv)
    assert info.value.args[1]["tokens"] == read
    ns = build_parser().parse_args(argv)
    assert quant.sizes(ns)["tokens"] == tokens
    assert quant.sizes(argparse.Namespace(**{**vars(ns), "tokens": None}))["tokens"] == (512 if ns.quick else 2048)


def test_fuzz_quant_reaches_the_fuzzer(reach, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Reached) as info:
        main(["fuzz", "--layouts", "2", "--positions", "3", "--quant", "4"])
    assert info.value.args[0] == (2,) and info.value.args[1]["positions"] == 3


def test_lm_eval_default_kinds_pass_the_checks(reach, tmp_path, monkeypatch):
    """The README's lm-eval command (no --kinds) failed in check(), before any work."""
    monkeypatch.chdir(tmp_path)
    for argv in (["lm-eval", "--json", "out/lm_eval.json", "--plot", "out/lm_eval.png"], ["lm-eval", "--quick"]):
        with pytest.raises(Reached):  # the model load: the first work
            main(argv)


def test_certify_real_lm_chunk_is_checked_before_the_model_loads(reach, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["certify", "--real", "--datasets", "smollm2", "--lm-chunk", "512"]) == 2
    assert "--lm-chunk 512 does not fit" in capsys.readouterr().err
