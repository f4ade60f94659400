"""The report as pages: report.md (figures linked) and report.html, one self-contained file (figures embedded
as data URIs, no script, no external style), readable offline and in any browser."""
from __future__ import annotations

import base64
import html
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from .tables import cells, markdown


@dataclass
class Table:
    title: str
    table: pd.DataFrame


@dataclass
class Figure:
    title: str
    path: Path  # a .png (or the first plot format)


@dataclass
class Items:
    title: str
    lines: list


def markdown_page(heading: str, sections: list, out: Path) -> str:
    parts = [f"# {heading}\n"]
    for section in sections:
        if isinstance(section, Table):
            parts.append(f"## {section.title}\n\n{markdown(section.table)}")
        elif isinstance(section, Figure):
            parts.append(f"![{section.title}]({section.path.relative_to(out).as_posix()})\n")
        else:
            parts.append(f"## {section.title}\n\n" + "".join(f"- {line}\n" for line in section.lines))
    return "\n".join(parts)


STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:75em;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:0.5em 0 1.5em;font-size:0.9em}th,td{border:1px solid #ccc;padding:0.25em 0.6em}
th{background:#f2f2f2}td.num{text-align:right;font-variant-numeric:tabular-nums}td.sig{font-weight:bold}
figure{margin:1em 0}img{max-width:100%}figcaption{color:#555;font-size:0.9em}h2{font-size:1.15em;margin-top:2em}"""


def _table_html(table: pd.DataFrame) -> str:
    numeric = [pd.api.types.is_numeric_dtype(table[c]) for c in table.columns]
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in table.columns)
    rows = []
    for row in cells(table, ".2f"):
        tds = []
        for text, is_number in zip(row, numeric):
            css_class = "sig" if text.endswith("*") else "num" if is_number else ""
            tds.append(f'<td class="{css_class}">{html.escape(text)}</td>' if css_class else f"<td>{html.escape(text)}</td>")
        rows.append("<tr>" + "".join(tds) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def html_page(heading: str, sections: list) -> str:
    body = [f"<h1>{html.escape(heading)}</h1>"]
    for section in sections:
        if isinstance(section, Table):
            body.append(f"<h2>{html.escape(section.title)}</h2>{_table_html(section.table)}")
        elif isinstance(section, Figure):
            data = base64.b64encode(section.path.read_bytes()).decode()
            mime = "image/svg+xml" if section.path.suffix == ".svg" else f"image/{section.path.suffix.lstrip('.')}"
            body.append(f'<figure><img alt="{html.escape(section.title)}" src="data:{mime};base64,{data}">'
                        f"<figcaption>{html.escape(section.title)}</figcaption></figure>")
        else:
            items = "".join(f"<li>{html.escape(line)}</li>" for line in section.lines)
            body.append(f"<h2>{html.escape(section.title)}</h2><ul>{items}</ul>")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(heading)}</title>'
            f"<style>{STYLE}</style></head><body>{''.join(body)}</body></html>\n")
