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
