"""Every field of a config dataclass with its type, default and meaning, read from the class itself:
the annotation, the default, and the comment that follows the field in its source (continued on the
comment lines below it). `meshlm train --help` prints these for ModelConfig and TrainConfig, so the
help cannot drift from the code."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
from typing import Any, NamedTuple


class FieldDoc(NamedTuple):
    name: str
    kind: str  # the annotation, e.g. "int", "str | None", "list[float]"
    default: Any
    meaning: str  # the field's comment ("" when it has none)


def _comments(source: str) -> dict[int, str]:
    """line number -> the text of the comment on that line."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.start[0]: t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT}


def field_docs(cls) -> list[FieldDoc]:
    """The fields of dataclass `cls`, in order, each with its comment (and the comment-only lines
    below it)."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments, lines = _comments(source), source.splitlines()
    meanings = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        parts, line = [comments.get(node.end_lineno, "")], node.end_lineno + 1
        while (line in comments and lines[line - 1].lstrip().startswith("#")
               and not comments[line].startswith("--")):
            parts.append(comments[line])
            line += 1
        meanings[node.target.id] = " ".join(p for p in parts if p)
    return [FieldDoc(f.name, str(f.type), _default(f), meanings.get(f.name, ""))
            for f in dataclasses.fields(cls)]


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def describe(cls, title: str, width: int = 100) -> str:
    """A help section: one `name: type = default` line per field and its meaning, wrapped and
    indented."""
    out = textwrap.wrap(title, width, subsequent_indent="    ")
    for doc in field_docs(cls):
        out.append(f"  {doc.name}: {doc.kind} = {doc.default!r}")
        if doc.meaning:
            out += textwrap.wrap(doc.meaning, width, initial_indent=" " * 6,
                                 subsequent_indent=" " * 6)
    return "\n".join(out)
