"""Which meshlm sources an exported folder's remote code carries: derived from the import graph.

    bundle_sources("meshlm.hf.modeling", PACKAGE, provided)   -> ("errors.py", …, "hf/modeling.py")

The sources are the entry module and every module it imports, directly or through the others, read
with `ast` (nothing is imported or run). Only imports that execute count: those under `if
TYPE_CHECKING:` are not followed. `from meshlm.pkg import Name`, where meshlm/pkg/__init__.py only
re-exports Name, leads to the module that defines Name, not to the package, which would drag in all
it re-exports. The order is the one the concatenated file runs in: every module after the modules it
imports at its top level (a depth-first post-order, in the order of the imports); modules imported
inside functions are needed only when those run, so they may come later. `provided` modules are
supplied by the folder in another way and not followed.
"""
from __future__ import annotations

import ast
from pathlib import Path


class _Graph:
    """The import graph of one package (its directory's name is the package's import name)."""

    def __init__(self, package: Path):
        self.package, self.root = package, package.name
        self._trees: dict[str, ast.Module] = {}

    def file(self, module: str) -> Path | None:
        """The source of a module of the package, or None where there is none."""
        if module != self.root and not module.startswith(self.root + "."):
            return None
        base = self.package.joinpath(*module.split(".")[1:])
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
        return None

    def tree(self, module: str) -> ast.Module:
        if module not in self._trees:
            path = self.file(module)
            self._trees[module] = ast.parse(path.read_text(), filename=str(path))
        return self._trees[module]

    def imports(self, module: str) -> list[tuple[str, bool]]:
        """(imported module of the package, at the module's top level) for each executed import."""
        tree, out = self.tree(module), []
        skip = {id(n) for node in ast.walk(tree) if is_type_checking(node) for n in ast.walk(node)}
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                targets = [self.origin(node.module, a.name) for a in node.names]
            else:
                continue
            out += [(t, id(node) in top) for t in targets if self.file(t) is not None]
        return out

    def origin(self, module: str, name: str) -> str:
        """The module `from module import name` depends on: the submodule `name`, or, for a package
        that only re-exports `name`, the module it imports it from; else `module` itself."""
        if self.file(f"{module}.{name}") is not None:
            return f"{module}.{name}"
        path = self.file(module)
        if path is None or path.name != "__init__.py":
            return module
        for node in self.tree(module).body:
            if isinstance(node, ast.ImportFrom) and not node.level and node.module and \
                    any((a.asname or a.name) == name for a in node.names):
                alias = next(a for a in node.names if (a.asname or a.name) == name)
                return self.origin(node.module, alias.name)
        return module

    def relative(self, module: str) -> str:
        return self.file(module).relative_to(self.package).as_posix()


def is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"


def bundle_sources(entry: str, package: Path, provided: frozenset[str] = frozenset(),
                   also: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The package-relative source files `entry` needs, in an order that runs top to bottom, and
    after them those of the modules in `also` (reached by name, not by an import: layer modules)."""
    graph, seen, order = _Graph(package), set(), []

    def visit(module: str) -> None:
        if module in seen or module in provided:
            return
        seen.add(module)
        imports = graph.imports(module)
        for target, top in imports:
            if top:
                visit(target)
        order.append(graph.relative(module))
        for target, top in imports:
            if not top:
                visit(target)

    for module in (entry, *also):
        visit(module)
    return tuple(order)
