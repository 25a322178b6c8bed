"""Packages, found rather than listed: every package under ``autopart/``, and the top-level
``passes/`` folder installed as ``autopart.passes`` (the project's layout keeps the compiler
passes beside the package). Everything else about the project is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["autopart", "autopart.*"]), "autopart.passes"],
    package_dir={"autopart.passes": "passes"},
)
