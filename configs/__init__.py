"""hprune's configs. Hydra imports this package to read them: the resolvers they use are registered here."""
import hprune.launch  # noqa: F401  (hprune.run_name, hprune.rank_zero_only, hprune.rank_zero_file)
