"""The wheel's packages, found rather than listed (pyproject.toml has the rest of the build).

A package list written by hand once left a new ``checks/<x>/`` package out of the wheel: it
imported from a checkout and was missing from every install. ``[tool.setuptools.packages.find]``
cannot find them either: it names a package after its folder, and ``checks/`` and ``config/`` are
installed as ``gpumon_checks`` and ``gpumon_config`` (pyproject's ``package-dir``). So each folder
is searched here and its packages named under the name it is installed as.
"""

from setuptools import find_packages, setup

# folder in the checkout -> the import package it is installed as (pyproject's package-dir)
INSTALLED_AS = {"gpumon": "gpumon", "checks": "gpumon_checks", "config": "gpumon_config"}


def packages() -> list[str]:
    found = []
    for folder, name in INSTALLED_AS.items():
        # a folder without __init__.py is not a package (config/'s data folders): not found
        found += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]
    return found


setup(packages=packages())
