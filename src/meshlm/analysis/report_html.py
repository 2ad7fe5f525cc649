"""The HTML pieces of `meshlm report`'s page: its style sheet, table cells (best value bold, ± one
standard error), tables, inlined PNG images and the page around a body."""
from __future__ import annotations

import base64
import html

STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:14px}
th,td{border:1px solid #ccc;padding:4px 8px;text-align:right}th{background:#f3f3f3}
td.l,th.l{text-align:left;white-space:nowrap}img{max-width:100%;margin:0.5em 0}
.note{color:#a33}.foot{font-size:13px;color:#555}code{background:#f5f5f5;padding:1px 4px}"""


def cells(values: list[float | None], lower_is_better: bool, fmt: str,
          errors: list[float | None] | None = None) -> list[str]:
    """One <td> per value, the best in bold, each with its standard error (± e) where `errors` has
    one."""
    present = [v for v in values if v is not None]
    best = (min if lower_is_better else max)(present) if len(present) > 1 else None
    errors = errors or [None] * len(values)
    return ["<td>—</td>" if v is None else f"<td>{'<b>' if v == best else ''}{fmt.format(v)}"
            f"{'</b>' if v == best else ''}"
            f"{'' if e is None else f' <small>± {fmt.format(e)}</small>'}</td>"
            for v, e in zip(values, errors)]


def percent(values: list[float | None]) -> list[float | None]:
    return [None if v is None else 100 * v for v in values]


def table(header: list[str], columns: list[list[str]], n_rows: int) -> str:
    """A table of `columns` (each a list of <td> cells); the first two header cells left-aligned."""
    head = "".join(f"<th class='l'>{h}</th>" if i < 2 else f"<th>{h}</th>"
                   for i, h in enumerate(header))
    rows = "".join("<tr>" + "".join(col[r] for col in columns) + "</tr>" for r in range(n_rows))
    return f"<table><tr>{head}</tr>{rows}</table>"


def img(png: bytes) -> str:
    return f"<img src='data:image/png;base64,{base64.b64encode(png).decode('ascii')}'>"


def html_page(title: str, body: str) -> str:
    """The whole document: `body` under the style sheet, `title` escaped."""
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>{body}</body></html>\n")
