"""The two distributions of the repository, built as a user's pip would build them: the library
wheel ``streamkv`` holds the library only and requires torch alone (everything else behind an
extra); the lab wheel ``streamkv-lab`` holds the ``streamkv`` command and the toy model's weights,
so that ``streamkv demo`` runs from a plain install."""

import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheels")
    for project in (ROOT, ROOT / "lab"):
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                        "--disable-pip-version-check", "-w", str(out), str(project)], check=True,
                       capture_output=True, text=True, cwd=project)
    found = {p.name.split("-")[0]: p for p in out.glob("*.whl")}
    assert set(found) == {"streamkv", "streamkv_lab"}, found
    return found


def _metadata(wheel: Path) -> tuple[list[str], dict]:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(z.read(meta).decode())
        entry = next((n for n in names if n.endswith("entry_points.txt")), None)
        entry_points = z.read(entry).decode() if entry else ""
    return names, {"requires": msg.get_all("Requires-Dist") or [], "license": msg.get("License-Expression"),
                   "entry_points": entry_points, "version": msg.get("Version")}


def test_the_library_wheel_is_the_library_on_torch_alone(wheels):
    names, meta = _metadata(wheels["streamkv"])
    code = [n for n in names if n.endswith(".py")]
    assert code and all(n.startswith("streamkv/") for n in code), [n for n in code if not n.startswith("streamkv/")]
    assert not any("lab" in n.split("/") or "streamkv_lab" in n or "weights" in n for n in names)
    unconditional = [r for r in meta["requires"] if "extra ==" not in r]
    assert [r.split(";")[0].replace(" ", "").split("<")[0].split(">")[0] for r in unconditional] == ["torch"], meta
    assert meta["entry_points"] == ""  # the library installs no command
    assert meta["license"] == "Apache-2.0" and any(n.endswith("licenses/LICENSE") for n in names)


def test_the_lab_wheel_carries_the_command_and_the_weights(wheels):
    names, meta = _metadata(wheels["streamkv_lab"])
    assert "streamkv = streamkv_lab.cli:main" in meta["entry_points"]
    assert "streamkv_lab/video/weights/toy.safetensors" in names
    assert not any(n.startswith("streamkv/") for n in names)
    lib = _metadata(wheels["streamkv"])[1]
    assert f"streamkv=={lib['version']}" in [r.replace(" ", "") for r in meta["requires"]]
