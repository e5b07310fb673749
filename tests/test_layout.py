"""The repository's boundaries: tools/ holds scripts (each run with ``python -m tools.<name>``,
imported by nothing, importing no other tool); tests and the repository's packages import no
tool; the installed package imports none of the repository's packages."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("bench", "campaign", "pretrain", "megatron_abft")
"""The repository's Python packages; megatron_abft alone is installed."""


def _imported(path: Path) -> set[str]:
    """The top-level names of the modules ``path`` imports, lazy imports included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("folder", ["tests", *PACKAGES])
def test_no_test_or_package_imports_a_tool(folder):
    importing = [p.relative_to(ROOT) for p in _sources(folder) if "tools" in _imported(p)]
    assert importing == []


def test_tools_are_scripts():
    scripts = [p for p in _sources("tools") if p.name != "__init__.py"]
    assert scripts
    for path in scripts:
        assert "tools" not in _imported(path), path.name
        assert 'if __name__ == "__main__":' in path.read_text(), path.name


def test_the_installed_package_imports_no_repository_package():
    outside = set(PACKAGES) - {"megatron_abft"} | {"tools", "tests"}
    importing = {
        str(p.relative_to(ROOT)): _imported(p) & outside
        for p in _sources("megatron_abft")
        if _imported(p) & outside
    }
    assert importing == {}
