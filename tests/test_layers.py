"""The shape of the code: the library never imports the lab, no module imports upward, and
no module grows past ~400 lines without a reason written at its top."""

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "streamkv"

#: the library's layers, bottom first: a module may import its own layer and the ones below
LAYERS = [
    {"validate", "layout", "budget", "reference", "compiled", "masks"},
    {"stores", "quant"},
    {"storage"},
    {"scoring", "rotary", "positions", "rope_at_read", "blockread"},
    {"policies"},
    {"caches"},
    {"attention", "rope", "distributed", "recache", "kernels"},
    {"certify", "models", "compat"},
    {"rollout"},
    {"integrations"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _unit(module: str) -> str:
    """``streamkv.caches.cache`` -> ``caches``; ``streamkv.attention`` -> ``attention``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """Every streamkv module ``path`` imports (relative imports resolved), with its line."""
    rel = path.relative_to(SRC.parent).with_suffix("")
    package = list(rel.parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] in ("streamkv", "streamkv_lab")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] in ("streamkv", "streamkv_lab"):
                out.append((node.lineno, mod))
    return out


MODULES = sorted(p for p in SRC.rglob("*.py"))


def test_every_top_level_unit_has_a_layer():
    units = {p.relative_to(SRC).parts[0].removesuffix(".py") for p in MODULES} - {"__init__"}
    assert units <= set(RANK), f"units without a layer: {units - set(RANK)}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_no_upward_import(path):
    unit = path.relative_to(SRC).parts[0].removesuffix(".py")
    if unit == "__init__":
        return  # the package's lazy exports (import strings, resolved on first use)
    for line, mod in _imports(path):
        target = _unit(mod)
        if mod.split(".")[0] == "streamkv_lab" or target in ("", "__init__"):  # the lab: the next test
            continue
        assert RANK[target] <= RANK[unit], (
            f"{path.relative_to(SRC)}:{line} imports {mod} ({target}, layer {RANK[target]}) from layer {RANK[unit]}"
        )


def test_the_library_never_imports_the_lab():
    for path in MODULES:
        assert all(m.split(".")[0] != "streamkv_lab" for _, m in _imports(path)), f"{path} imports the lab"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_modules_are_small_or_say_why(path):
    lines = path.read_text().count("\n")
    if lines <= 430:
        return
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert "Why one module" in doc, f"{path.relative_to(SRC)} has {lines} lines and no 'Why one module' note at its top"


def test_the_import_check_can_fail(tmp_path):
    """Control: an upward relative import written into a copy of a library module is found."""
    pkg = tmp_path / "streamkv" / "policies"
    pkg.mkdir(parents=True)
    bad = pkg / "bad.py"
    bad.write_text("from ..caches import KVCache\nfrom .base import Step\n")
    found = [m for _, m in _imports_at(bad, tmp_path / "streamkv")]
    assert found == ["streamkv.caches", "streamkv.policies.base"]
    assert RANK[_unit(found[0])] > RANK["policies"]


def _imports_at(path, root):
    global SRC
    saved, SRC = SRC, root
    try:
        return _imports(path)
    finally:
        SRC = saved


LAB_ONLY = {"numpy", "rich", "matplotlib", "safetensors", "transformers", "diffusers"}


def _top_level_lab_imports(path) -> list[str]:
    out = []
    for node in ast.parse(path.read_text()).body:  # top-level imports only
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        out += [n for n in names if n.split(".")[0] in LAB_ONLY]
    return out


def test_the_library_needs_torch_only(tmp_path):
    """``pip install streamkv`` depends on torch alone: outside the lab, the integrations (which
    import their client lazily, inside functions, where the user has it) and the compat
    drop-ins, no module imports a lab dependency at its top level. (Control: a file that does
    is found.)"""
    for path in MODULES:
        if path.relative_to(SRC).parts[0] in ("lab", "integrations", "compat"):
            continue
        assert not _top_level_lab_imports(path), f"{path.relative_to(SRC)} imports a lab dependency at its top level"
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nimport numpy as np\nfrom rich.console import Console\n")
    assert _top_level_lab_imports(bad) == ["numpy", "rich.console"]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_module_docstrings_are_short_or_say_why(path):
    """The prose is told once (the chunk loop in ARCHITECTURE) and module docstrings stay near
    30 lines; a longer one says why (a proof, a worked example, the list of a client's refusals)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    if doc.count("\n") + 1 <= 32:
        return
    assert "Why this long" in doc or "Why one module" in doc, (
        f"{path.relative_to(SRC)}: a {doc.count(chr(10)) + 1}-line module docstring with no 'Why this long' note")
