"""Result files: Markdown tables and matplotlib plots, written atomically."""
