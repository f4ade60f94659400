"""Tables as Markdown (pandas' own to_markdown needs the optional tabulate package)."""
from __future__ import annotations

import pandas as pd


def markdown(table: pd.DataFrame, floatfmt: str = ".2f") -> str:
    def cell(value) -> str:
        if isinstance(value, float):
            return "" if pd.isna(value) else format(value, floatfmt)
        return str(value)

    lines = ["| " + " | ".join(map(str, table.columns)) + " |",
             "|" + "|".join("---:" if pd.api.types.is_numeric_dtype(table[c]) else "---" for c in table.columns) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines) + "\n"
