"""The wheel's packages and its checks, found rather than listed (pyproject.toml has the rest).

A package list written by hand once left a new ``checks/<x>/`` package out of the wheel: it
imported from a checkout and was missing from every install. ``[tool.setuptools.packages.find]``
cannot find them either: it names a package after its folder, and ``checks/`` and ``config/`` are
installed as ``gpumon_checks`` and ``gpumon_config`` (pyproject's ``package-dir``). So each folder
is searched here and its packages named under the name it is installed as.

The built-in checks' ``gpumon.checks`` entry points are found the same way, so that a check is one
file or folder under ``checks/`` and nothing else to edit: a top-level class whose name ends in
``Check`` and whose body sets ``name`` to a string is the check of that name. The source is read
(``ast``), not imported: a build must not need the checks' dependencies, nor run their code.
"""

import ast
from pathlib import Path

from setuptools import find_packages, setup

# folder in the checkout -> the import package it is installed as (pyproject's package-dir)
INSTALLED_AS = {"gpumon": "gpumon", "checks": "gpumon_checks", "config": "gpumon_config"}
HERE = Path(__file__).resolve().parent


def packages() -> list[str]:
    found = []
    for folder, name in INSTALLED_AS.items():
        # a folder without __init__.py is not a package (config/'s data folders): not found
        found += [name, *(f"{name}.{sub}" for sub in find_packages(str(HERE / folder)))]
    return found


def _checks_in(path: Path) -> list[tuple[str, str]]:
    """(check name, class name) of every check class defined at the top of ``path``."""
    found = []
    for node in ast.parse(path.read_text(encoding="utf-8"), str(path)).body:
        if not (isinstance(node, ast.ClassDef) and node.name.endswith("Check")):
            continue
        for stmt in node.body:
            target = (stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                      else stmt.target if isinstance(stmt, ast.AnnAssign) else None)
            value = getattr(stmt, "value", None)
            if (isinstance(target, ast.Name) and target.id == "name" and isinstance(value, ast.Constant)
                    and isinstance(value.value, str)):
                found.append((value.value, node.name))
    return found


def check_entry_points() -> list[str]:
    folder = HERE / "checks"
    where: dict[str, str] = {}
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(folder).with_suffix("")
        if "__pycache__" in rel.parts or rel.name == "__init__" or rel.name.startswith("test"):
            continue
        module = ".".join((INSTALLED_AS["checks"], *rel.parts))
        for name, cls in _checks_in(path):
            if name in where:
                raise SystemExit(f"two checks named {name!r}: {where[name]} and {module}:{cls}")
            where[name] = f"{module}:{cls}"
    return [f"{name} = {target}" for name, target in sorted(where.items())]


# setuptools runs this file as __main__ (pip's build backend and ``python setup.py`` alike);
# tools/gen_reference.py imports it for _checks_in, the one rule of what a check is
if __name__ == "__main__":
    setup(packages=packages(), entry_points={"console_scripts": ["gpumon = gpumon.cli:main"],
                                             "gpumon.checks": check_entry_points()})
