"""The package's import structure: layers that every import points down (LAYERS), no cycle among
meshlm modules, dependencies visible at the top of each module, a model that imports nothing of
training, data or files, and a config that validates without torch."""
import ast
import functools
import json
import subprocess
import sys
from pathlib import Path

import meshlm

PACKAGE = Path(meshlm.__file__).resolve().parent
# The only imports that may stay inside functions outside meshlm/commands (whose modules the CLI
# loads lazily to keep `meshlm --help` fast): heavy dependencies that most commands never touch.
# meshlm.hf and meshlm.evaluation.harness are the transformers and lm-eval integrations: importing
# them imports those.
LAZY_ALLOWED = ("transformers", "huggingface_hub", "argcomplete", "wandb", "mlflow", "peft",
                "lm_eval",
                "matplotlib", "datasets", "pyarrow",
                "torch.utils.tensorboard", "meshlm.hf", "meshlm.evaluation.harness")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of import nodes under `if TYPE_CHECKING:` (never executed, so no dependency)."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            ids |= {id(n) for n in ast.walk(node)}
    return ids


@functools.cache
def _tree(name: str) -> ast.AST:
    return ast.parse(MODULES[name].read_text())  # parsed once per test session


def imports(name: str, type_checking: bool = False) -> list[tuple[ast.AST, list[str], bool]]:
    """(node, imported modules, inside a function) for every executed import in module `name`; with
    `type_checking`, also those under `if TYPE_CHECKING:`."""
    return imports_in(_tree(name), type_checking)


def imports_in(tree: ast.AST, type_checking: bool = False) -> list[tuple[ast.AST, list[str], bool]]:
    """imports() of one parsed module."""
    skip, out = set() if type_checking else _type_checking_only(tree), []
    in_function = {id(n) for f in ast.walk(tree)
                   if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f)}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from pkg import sub` imports the module pkg.sub where there is one, else names from
            # pkg
            targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES
                       else node.module
                       for a in node.names]
        else:
            continue
        out.append((node, targets, id(node) in in_function))
    return out


def graph(type_checking: bool = False) -> dict[str, set[str]]:
    """module -> the meshlm modules it imports (at any level; with `type_checking`, also those
    under TYPE_CHECKING)."""
    return {name: set(targets) for name, targets in _graph(type_checking).items()}  # a copy to edit


@functools.cache
def _graph(type_checking: bool) -> dict[str, frozenset[str]]:
    return {name: frozenset(t for _, targets, _ in imports(name, type_checking) for t in targets
                            if t in MODULES and t != name)
            for name in MODULES}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_meshlm_modules_import_each_other_without_a_cycle():
    edges = graph()
    assert sum(map(len, edges.values())) > 100  # the graph is really built
    assert ("meshlm.config" in edges["meshlm.model.lm"]
            and "meshlm.backbones" in edges["meshlm.config"])
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def lazy_allowed(module: str) -> bool:
    return any(module == heavy or module.startswith(heavy + ".") for heavy in LAZY_ALLOWED)


def test_imports_are_at_module_top_level_outside_commands():
    late = [f"{name}:{node.lineno} imports {', '.join(targets)}"
            for name in MODULES if not name.startswith("meshlm.commands.")
            for node, targets, in_function in imports(name)
            if in_function and not all(map(lazy_allowed, targets))]
    assert late == []


def test_the_model_imports_nothing_of_training_data_or_files():
    code = "import sys, json, meshlm.model; print(json.dumps(sorted(sys.modules)))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True).stdout)
    ours = [m for m in loaded if m.startswith("meshlm")]
    allowed = {"meshlm", "meshlm.errors", "meshlm.fields", "meshlm.backbones", "meshlm.config",
               "meshlm.layout", "meshlm.presets"}
    assert "meshlm.model.lm" in ours
    assert [m for m in ours if m not in allowed and not m.startswith("meshlm.model")] == []
    assert not any(m.split(".")[0] in ("transformers", "datasets", "safetensors", "tokenizers")
                   for m in loaded)


def test_the_config_and_both_registries_need_no_torch():
    code = ("import sys, json, meshlm.config; meshlm.config.ModelConfig(backbone='olmoe', "
            "scheme='mesh', scheme_options={'slots': 6}); print(json.dumps(sorted(sys.modules)))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True).stdout)
    assert "torch" not in loaded and not any(m.startswith("meshlm.model") for m in loaded)


# -- layers: every import points down ------------------------------------------------------------
# Lowest first; a module is in the layer of the longest prefix naming it. An import may point
# into its own layer or a lower one, never up. The family and format adapters sit below the
# loader (as torchtitan's state-dict adapters do): meshlm.loading asks them, they never ask it.
LAYERS = (
    ("foundation", ("meshlm", "meshlm.errors", "meshlm.fields", "meshlm.fielddocs", "meshlm.atomic",
                    "meshlm.yaml_files", "meshlm.layout")),
    ("registry of backbones", ("meshlm.backbones",)),
    ("model config", ("meshlm.config",)),
    ("model", ("meshlm.model",)),
    ("this machine", ("meshlm.machine", "meshlm.data.cache_dir")),  # its measured facts, its cache
    ("compiled kernels", ("meshlm.kernels",)),  # below runtime and quant, which both use them
    ("below the loader",  # data, runtime, checkpoints, model folders (Hub, formats, integrity),
     # LoRA/int8 structure, family adapters
     ("meshlm.data", "meshlm.reasoning", "meshlm.runtime", "meshlm.checkpoint", "meshlm.folders",
      "meshlm.outputs", "meshlm.adapters", "meshlm.quant", "meshlm.interop")),
    ("loader", ("meshlm.loading",)),
    ("users of a model", ("meshlm.train", "meshlm.evaluation", "meshlm.generate", "meshlm.analysis",
                          "meshlm.serve", "meshlm.hf", "meshlm.quant.report",
                          "meshlm.interop.convert", "meshlm.interop.retrofit", "meshlm.decoding")),
    ("commands", ("meshlm.commands",)),
    ("command line", ("meshlm.cli",)),
)


def layer_of(module: str) -> int:
    """Index in LAYERS of the longest prefix naming `module`."""
    named = [(len(prefix), index) for index, (_, prefixes) in enumerate(LAYERS)
             for prefix in prefixes if module == prefix or module.startswith(prefix + ".")]
    assert named, f"{module} is in no layer: add it to LAYERS"
    return max(named)[1]


def upward_arrows() -> list[str]:
    """Every import (TYPE_CHECKING-only and lazy ones too) from a lower layer to a higher one."""
    executed = _graph(False)
    return [f"{a} -> {b} ({LAYERS[layer_of(a)][0]} -> {LAYERS[layer_of(b)][0]}"
            f"{'; TYPE_CHECKING only' if b not in executed[a] else ''})"
            for a, targets in sorted(_graph(True).items()) for b in sorted(targets)
            if layer_of(b) > layer_of(a)]


def test_every_module_is_in_a_layer_and_every_layer_holds_one():
    assert {layer_of(m) for m in MODULES} == set(range(len(LAYERS)))
    below, loader = layer_of("meshlm.folders.formats"), layer_of("meshlm.loading")
    assert layer_of("meshlm.model") < below == layer_of("meshlm.quant.calibrate") < loader
    assert loader < layer_of("meshlm.interop.convert") == layer_of("meshlm.hf")


def test_model_folders_are_read_below_the_checkpoint_writer_and_the_loader():
    """meshlm.folders (locate, formats, integrity, hub) imports neither meshlm.checkpoint nor
    meshlm.loading; the writer imports the reading side (meshlm.folders.integrity), not the
    reverse."""
    edges = graph(type_checking=True)
    folders = [m for m in MODULES if m == "meshlm.folders" or m.startswith("meshlm.folders.")]
    assert len(folders) == 5
    assert [f"{m} -> {t}" for m in folders for t in sorted(edges[m])
            if t in ("meshlm.checkpoint", "meshlm.loading")] == []
    assert "meshlm.folders.integrity" in edges["meshlm.checkpoint"]
    assert {"meshlm.folders.locate", "meshlm.folders.formats"} <= edges["meshlm.loading"]


def test_the_layer_check_sees_type_checking_imports():
    assert "meshlm.fields" in graph()["meshlm.config"]  # a real import that points down: allowed
    assert layer_of("meshlm.config") > layer_of("meshlm.fields")
    source = ("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
              "    from meshlm.config import ModelConfig\n")
    hinted = [targets for _, targets, _ in imports_in(ast.parse(source), type_checking=True)]
    assert ["meshlm.config"] in hinted  # counted as an arrow ...
    assert ["meshlm.config"] not in [t for _, t, _ in imports_in(ast.parse(source))]  # ... not run


def test_no_circle_even_through_type_checking_imports():
    cycle = find_cycle(graph(type_checking=True))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_runtime_and_quant_import_each_other_in_neither_direction():
    """They meet below, in meshlm.kernels, and above, in meshlm.decoding (TYPE_CHECKING-only
    imports count too). quant's layers, which a Hugging Face export bundles (meshlm.hf.remote),
    import no kernel code: meshlm.quant.row_kernel gives them the compiled one."""
    packages = ("meshlm.runtime", "meshlm.quant")
    crossing = [f"{a} -> {b}" for a, targets in sorted(graph(type_checking=True).items())
                for b in sorted(targets) for mine, other in (packages, packages[::-1])
                if a.startswith(mine + ".") or a == mine
                if b.startswith(other + ".") or b == other]
    assert crossing == []
    assert "meshlm.kernels.kernel" in graph()["meshlm.quant.row_kernel"]
    assert not {m for m in graph()["meshlm.quant.linear"] | graph()["meshlm.quant.calibrate"]
                if m.startswith("meshlm.kernels")}


def test_every_import_points_down_the_layers():
    """Lazy and TYPE_CHECKING-only imports too: the backbone registry reads a model config through
    a protocol (meshlm.backbones.ConfigView), not by importing the config that validates through
    it."""
    assert upward_arrows() == []


def test_the_train_config_is_plain_data_that_needs_no_torch():
    """`import meshlm.train.config` and a validated TrainConfig load neither torch nor the model,
    and read no file: init_from is resolved later (meshlm.train.plan), not while validating."""
    code = ("import sys, json, meshlm.train.config as c; "
            "c.load_config(None, ['model.preset=tiny', 'train.lr=1e-3']); "
            "c.TrainConfig(init_from='/nowhere/at/all', model={'d_model': 96}); "
            "print(json.dumps(sorted(sys.modules)))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True).stdout)
    assert "torch" not in loaded and "meshlm.train.config" in loaded
    heavy = ("meshlm.model", "meshlm.loading", "meshlm.data", "meshlm.train.trainer",
             "meshlm.train.plan")
    assert [m for m in loaded if m.startswith(heavy)] == []
