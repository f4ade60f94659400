"""The `hprune` command: a thin dispatcher in front of one Hydra app per verb.

The folder is cli/ (the project's layout); installed, it is the package `hprune_cli` (setup.cfg's package_dir),
since a top-level package named `cli` would clash with any other project's. Import it as `hprune_cli`."""
