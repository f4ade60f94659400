"""Choosing heads to prune: scores, the head-mask schema, physical removal (in the plugin)."""
