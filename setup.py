"""The packages are found, not listed (setup.cfg holds everything else): every package under src/, namespace
packages included (hydra_plugins, which Hydra requires to have no __init__.py), and the CLI and the configs, kept at
the top level and installed under their package names (setup.cfg's package_dir)."""
from setuptools import find_namespace_packages, setup

setup(packages=find_namespace_packages("src", exclude=["*__pycache__*"]) + ["hprune_cli", "hprune_configs"])
