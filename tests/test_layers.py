"""The house's order holds: the stage packages import only downwards (import-linter's
contracts in pyproject.toml, which `make test` runs first), and no module reaches into
another's underscored names."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, capture_output=True, text=True,
                          env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"}, timeout=120)


def test_the_contracts_hold_on_this_tree():
    r = _lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Contracts: 4 kept, 0 broken." in r.stdout


def test_an_import_back_up_fails_the_lint(tmp_path):
    """A planted import from the tokenizer into the packer (a floor above it) breaks the prep
    contract, and it is named: the layers are really enforced, not just listed."""
    for d in ("prep", "train"):
        shutil.copytree(ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    costs = tmp_path / "prep" / "tokens" / "costs.py"
    costs.write_text(costs.read_text() + "\nfrom prep.pack import packing  # planted\n")
    r = _lint(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "prep: each stage imports only the stages below it BROKEN" in r.stdout
    assert "- prep.tokens.costs -> prep.pack.packing" in r.stdout
    # and through it train, which may read only prep.schema and prep.tokens
    assert "train reads datasets through prep.schema and prep.tokens only BROKEN" in r.stdout
    assert "Contracts: 2 kept, 2 broken." in r.stdout


def _private_reaches(path: Path, own: str, root: Path = ROOT) -> list[str]:
    """``from M import _x`` and ``M._x`` (M a module of this project, not ``own``)."""
    tree = ast.parse(path.read_text())
    aliases, found = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] not in ("prep", "train", "bench") or node.module == own:
                continue
            for a in node.names:
                if a.name.startswith("_"):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: from {node.module} "
                                 f"import {a.name}")
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ("prep", "train", "bench") and a.name != own:
                    aliases[a.asname or a.name.split(".")[0]] = a.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_uses_another_modules_underscored_names():
    found = []
    for pkg in ("prep", "train", "bench"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            own = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            found += _private_reaches(path, own)
    assert found == []


def test_the_private_name_check_finds_a_planted_reach(tmp_path):
    p = tmp_path / "prep" / "tokens" / "planted.py"
    p.parent.mkdir(parents=True)
    p.write_text("from prep.ingest.atlas import _FAST, AtlasConfig\nfrom prep.ingest import atlas\n"
                 "x = atlas._FAST + atlas.BATCH\n")
    assert _private_reaches(p, "prep.tokens.planted", tmp_path) == [
        "prep/tokens/planted.py:1: from prep.ingest.atlas import _FAST",
        "prep/tokens/planted.py:3: atlas._FAST"]
