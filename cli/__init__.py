"""The `hprune` command: a thin dispatcher in front of one Hydra app per verb."""
