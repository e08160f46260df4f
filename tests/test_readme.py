"""The documentation runs as written: every ```python block of README.md and docs/**/*.md, and
every ``streamkv`` command line they show.

Blocks are found, not listed: a block added to (or changed in) any of those files is run by
:func:`test_block_runs_as_written` in a fresh interpreter (nothing defined by another block or by
this file). A block that cannot run on this machine's CPU says why on its first line
(``# needs: CUDA``, ``# needs: sglang with its own requirements``); it is compiled and every
name it uses must be defined in it, imported by it or a builtin (:func:`undefined_names`), so a
placeholder (``model = load(name)``) fails there too.
"""

from __future__ import annotations

import builtins
import os
import re
import shlex
import subprocess
import symtable
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from streamkv.policies import POLICIES, example_policy

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
DOC_FILES = (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")))
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
NEEDS = re.compile(r"#\s*needs:\s*(.*\S)")
TIMEOUT_S = 600  # per block; the slowest (SmolLM2 loaded from its GGUF, 16 tokens generated) takes well under it


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def needs(self) -> str | None:
        """Why the block cannot run here (its first line's ``# needs:`` marker), or None."""
        first = self.code.lstrip("\n").split("\n", 1)[0]
        m = NEEDS.fullmatch(first.strip())
        return m.group(1) if m else None


def python_blocks(text: str, path: Path = ROOT / "README.md") -> list[Block]:
    return [Block(path, text.count("\n", 0, m.start()) + 1, m.group(1)) for m in FENCE.finditer(text)]


BLOCKS = [b for p in DOC_FILES for b in python_blocks(p.read_text(), p)]
RUN = [b for b in BLOCKS if b.needs is None]
MARKED = [b for b in BLOCKS if b.needs is not None]


def undefined_names(code: str) -> set[str]:
    """Names the code reads that it never binds (assignment, import, def, class, loop or ``with``
    target, parameter) in the scope they resolve to, and that are not builtins."""
    top = symtable.symtable(code, "<block>", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    known = bound | set(dir(builtins))
    missing: set[str] = set()

    def visit(table: symtable.SymbolTable) -> None:
        for sym in table.get_symbols():
            if not sym.is_referenced():
                continue
            module_level = table is top or (sym.is_global() and not sym.is_local())
            if module_level and sym.get_name() not in known:
                missing.add(sym.get_name())
        for child in table.get_children():
            visit(child)

    visit(top)
    return missing


def test_every_python_block_is_found():
    """The fence pattern finds every ```python fence of every file (none is skipped silently),
    and README.md has blocks to run."""
    for path in DOC_FILES:
        text = path.read_text()
        assert len(python_blocks(text, path)) == len(re.findall(r"^```python", text, re.M)), path
    assert any(b.path.name == "README.md" for b in RUN)


def test_the_names_check_finds_placeholders():
    """The check that marked blocks get can fail: names used but never defined are found, in
    nested scopes too; what is imported, assigned, a parameter or a builtin is not."""
    code = ("import torch\nfrom x import y as z\nmodel = load(name)\nfor i in range(3):\n    print(i, z)\n"
            "def f(a):\n    return a + k_shape\nwith open('p') as fh:\n    fh.read()\n"
            "squares = [j * j for j in ids]\nclass C:\n    spec = torch.zeros(1)\n")
    assert undefined_names(code) == {"load", "name", "k_shape", "ids"}


@pytest.mark.parametrize("block", RUN, ids=[b.name for b in RUN])
def test_block_runs_as_written(block, tmp_path):
    """The block alone in a fresh interpreter (its own imports and names only), from an empty
    folder, with this checkout's ``src`` first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
           "TQDM_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "-c", block.code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{block.name} failed:\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("block", MARKED, ids=[b.name for b in MARKED])
def test_a_block_that_needs_more_than_this_machine_compiles_and_defines_its_names(block):
    assert len(block.needs) >= 4, f"{block.name}: say what it needs and why"
    compile(block.code, block.name, "exec")
    assert not undefined_names(block.code), f"{block.name} uses names it never defines: {undefined_names(block.code)}"


@pytest.mark.parametrize("kind", list(POLICIES))
def test_the_api_loop_runs_for_every_kind(kind):
    """The API loop with each kind in place of the ring (its example parameters), checked after it ran."""
    code = next(b.code for b in RUN if "caches = CacheSet(" in b.code and "for c in range(12)" in b.code)
    assert '"ring",' in code
    params = "".join(f" {k}={v!r}," for k, v in example_policy(kind).items())
    code = code.replace('"ring",', f'"{kind}",{params}', 1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    caches, out = scope["caches"], scope["out"]
    assert out.shape == (1, 16, 4, 32) and torch.isfinite(out).all()
    for branch in ("cond", "uncond"):
        cache = caches[branch]
        assert cache.next_chunk == 12 and not cache.is_open
        assert (cache.slot_positions >= 0).sum() > 0
    if kind != "chronological":  # the ring and the scored kinds: nothing moved, sinks pinned
        assert (caches["cond"].slot_positions[..., :16] == torch.arange(16)).all()


# --------------------------------------------------------------------- command lines
def command_lines(text: str) -> list[str]:
    """Every ``streamkv <subcommand> ...`` in backticks (a span may wrap over lines), except a
    synopsis with placeholders (``--layouts N --json PATH``)."""
    from streamkv_lab.cli import SUBCOMMANDS

    out = []
    prose = re.sub(r"^```.*?^```[ \t]*$", "", text, flags=re.S | re.M)  # fenced blocks are not spans
    for span in re.findall(r"`([^`]+)`", prose):
        words = " ".join(span.split())
        m = re.match(r"(?:\S*/)?streamkv (\S+)(.*)", words)
        if not m or m.group(1) not in SUBCOMMANDS:
            continue
        argv = shlex.split(words)[1:]
        if any(re.fullmatch(r"[A-Z][A-Z_]*", a) for a in argv):
            continue
        out.append(" ".join(argv))
    return out


COMMANDS = sorted({c for p in DOC_FILES for c in command_lines(p.read_text())})


class Started(Exception):
    """The command passed its checks and started its work."""


def test_command_lines_are_found():
    assert "lm-eval --json out/lm_eval.json --plot out/lm_eval.png" in COMMANDS
    assert "positions --json out/positions.json --plot out/positions.png" in COMMANDS
    assert not any("N" in c.split() for c in COMMANDS)  # the fuzzer's synopsis is not a command


@pytest.mark.parametrize("argv", COMMANDS)
def test_every_command_line_shown_passes_the_checks(argv, tmp_path, monkeypatch, capsys):
    """Each command line of the docs, as written, is accepted (its checks refuse nothing; its
    run() is replaced: the work itself is the smoke tests' and the experiments')."""
    import importlib

    from streamkv_lab.cli import SUBCOMMANDS, main

    def started(args):
        raise Started

    name = argv.split()[0]
    monkeypatch.setattr(importlib.import_module(f"streamkv_lab.commands.{SUBCOMMANDS[name][0]}"), "run", started)
    monkeypatch.chdir(tmp_path)  # the commands' output paths (out/...)
    with pytest.raises(Started):
        main(shlex.split(argv))
