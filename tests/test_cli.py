"""The CLI: instant --help (no torch import), errors on stderr with a non-zero exit."""

import subprocess
import sys


def test_help_does_not_import_torch():
    code = "import sys, streamkv.lab.cli; streamkv.lab.cli.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_errors_go_to_stderr_with_exit_status_2(capsys):
    from streamkv.lab.cli import main

    assert main(["rollout", "--config", "huge"]) == 2
    err = capsys.readouterr().err
    assert "streamkv rollout: error: unknown model config 'huge'" in err


def test_bad_arguments_fail_before_any_work(tmp_path, capsys, monkeypatch):
    """Counts, output paths and devices are checked before the run (no 25-94 s of work first):
    the command's run() is never entered."""
    import importlib

    from streamkv.lab.cli import SUBCOMMANDS, main

    def must_not_run(args):
        raise AssertionError(f"{args.command} started before its arguments were checked")

    for module, _ in SUBCOMMANDS.values():
        monkeypatch.setattr(importlib.import_module(f"streamkv.lab.commands.{module}"), "run", must_not_run)

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
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)


def test_cuda_on_a_cpu_only_machine_is_one_clear_line(capsys):
    import pytest
    import torch

    from streamkv.lab.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: there is nothing to refuse")
    assert main(["rollout", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "has no CUDA device; use --device cpu" in err and "Traceback" not in err
