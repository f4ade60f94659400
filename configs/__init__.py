"""hprune's configs. Hydra imports this package to read them: the resolvers they use are registered here.

The folder is configs/ (the project's layout); installed, it is the package `hprune_configs` (setup.cfg's
package_dir; Hydra's config module, `initialize_config_module("hprune_configs")`), since a top-level package named
`configs` would clash with any other project's."""
import hprune.launch  # noqa: F401  (hprune.run_name, hprune.rank_zero_only, hprune.rank_zero_file)
