"""The package's imports run one way: no module of jax_ep imports a module of a package above its own, nor the
checkout's lab (bench, tools, tests)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jax_ep"
LAB = ("bench", "tools", "tests")


def _imports(path: Path):
    """(line, level, module, names) of each import statement of ``path``; level 0 for an absolute import."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            yield node.lineno, node.level, node.module or "", [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, 0, alias.name, []


def upward_imports(path: Path, root: Path = PACKAGE) -> list[str]:
    """The imports of ``path`` (a module under ``root``) that name a module of a package above its own, or the lab.

    ``from ..sibling import x`` is allowed where ``sibling`` is a subpackage that does not contain ``path``: it
    climbs only to reach across. ``from .. import module`` and ``from ..module import x`` are not.
    """
    found = []
    for line, level, module, names in _imports(path):
        where = f"{path.relative_to(root.parent)}:{line}"
        if level == 0:
            if module.split(".")[0] in LAB:
                found.append(f"{where}: imports the lab ({module})")
            continue
        if level < 2:
            continue
        base = path.parent
        for _ in range(level - 1):
            base = base.parent
        first = module.split(".")[0] if module else None
        targets = [first] if first else names
        for target in targets:
            package = base / target
            if not package.is_dir() or package in path.parents:
                found.append(f"{where}: imports {'.' * level}{module or target} from a package above its own")
    return found


def test_no_module_imports_from_a_package_above_its_own():
    found = [line for path in sorted(PACKAGE.rglob("*.py")) for line in upward_imports(path)]
    assert not found, "\n".join(found)


def test_the_check_finds_upward_imports(tmp_path):
    """The rule above, on a made-up package: a parent's module (both spellings) and the lab are found; a sibling
    subpackage's module and the own package's are not."""
    root = tmp_path / "pkg"
    for folder in (root / "a" / "b", root / "c"):
        folder.mkdir(parents=True)
    for name in ("__init__.py", "util.py", "a/__init__.py", "a/shared.py", "a/b/__init__.py", "c/__init__.py"):
        (root / name).write_text("")
    module = root / "a" / "b" / "mod.py"
    module.write_text(
        "from .. import shared\nfrom ..shared import x\nfrom ...util import y\nfrom ...c import z\n"
        "from . import near\nimport bench.timing\nimport numpy\n"
    )
    found = upward_imports(module, root)
    assert [line.split(":")[1] for line in found] == ["1", "2", "3", "6"], found
