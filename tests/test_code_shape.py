"""The package's shape: small files and small functions (docs/design.md), so the architecture
stays easy to see. Lines within 100 characters are ruff's job (pyproject.toml)."""
import ast
from pathlib import Path

import meshlm

PACKAGE = Path(meshlm.__file__).resolve().parent
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 50


def sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE)): p.read_text(encoding="utf-8")
            for p in sorted(PACKAGE.rglob("*.py"))}


def test_no_module_is_over_400_lines():
    long = {name: text.count("\n") for name, text in sources().items()
            if text.count("\n") > MAX_FILE_LINES}
    assert len(sources()) > 100 and long == {}


def test_no_function_is_over_50_lines():
    """Counted from `def` to the function's last line (its decorators excluded)."""
    long = [f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for name, text in sources().items() for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []
