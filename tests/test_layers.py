"""Imports run downward: no module of accelgen imports one from a higher layer, at module level, inside a function,
or at run time by naming it in a string (the method table, importlib.import_module); and no modules import each
other in a circle.

LAYERS is the architecture, lowest first. Each entry names a top-level module or package of accelgen; a module
may import its own layer and the layers below it, never one above. So a lower layer can be read, tested and
changed without the ones above it: the verification rules without the loop, the drafters without the trainers,
the loop without the command line.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import networkx  # a dependency of torch

import accelgen

LAYERS: list[tuple[str, set[str]]] = [
    # pure pieces with no accelgen imports of their own (processors and structured read only the draft type;
    # datasets only prompt encoding)
    ("foundation", {"errors", "atomic", "hardware", "theory", "draft", "sampling", "stopping", "cache", "quality", "prompts",
                    "processors", "structured", "datasets", "host_reads"}),
    # running the model (loading, weight formats and their probe, runners, batched and timed forwards) and the
    # pure verification rules
    ("models and verification", {"models", "verify"}),
    # measured forward costs and the policies' cost model
    ("costs", {"profile", "costs"}),
    # the trained heads (Medusa, EAGLE, exit heads, PaSS embeddings) with their load and save
    ("heads", {"heads"}),
    # how a method is declared: MethodSpec and its options, and the table naming the module of each built-in
    # method (read as strings and imported lazily by the registry, so the table sits below the methods), and a
    # call's settings (HF's vocabulary read into the loop's arguments, checked against the method's options)
    ("method declaration", {"registry", "method_table", "method_options", "settings"}),
    # the methods: drafters and early exits, each registering itself
    ("methods", {"drafters", "exits"}),
    # the generation loop and the transformers drop-in over it
    ("loop", {"loop", "hf"}),
    # what is built on generation: trainers, the benchmark, the server, export, tuning, advice, Skeleton-of-Thought,
    # and the non-autoregressive models (their own networks, trained through the trainers' loop)
    ("tools", {"train", "bench", "server", "export", "tune", "advice", "skeleton", "nar"}),
    # the interfaces: the command line and the package's public names (accelgen/__init__.py, imported as
    # `import accelgen`, which loads the loop and the models)
    ("interface", {"cli", "__init__", "__main__"}),
]
LAYER_OF = {name: index for index, (_, names) in enumerate(LAYERS) for name in names}
PACKAGE = Path(accelgen.__file__).parent

# A lazy table may name, in strings, modules of the layer that registers into it, above the table: the registry
# imports each on demand and it then registers itself with the registry (a plug-in's arrow, not an upward import).
# Only the method table, and only the methods layer: a table naming anything higher is an upward import.
LAZY_TABLES = {"accelgen.method_table": "methods"}  # the module holding the table -> the layer its strings may name



def top_level(module: str) -> str:
    """accelgen.models.batch -> "models"; accelgen itself (its __init__) -> "__init__"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(module: str) -> bool:
    path = PACKAGE.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(path: Path) -> set[str]:
    """The accelgen modules a file imports, anywhere in it. `from accelgen import cache` imports accelgen.cache;
    `from accelgen import generate_something` and `import accelgen` import the package's __init__."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            named = [f"{base}.{alias.name}" for alias in node.names]
            submodules = {name for name in named if is_module(name)}
            modules |= submodules | ({base} if len(submodules) < len(named) else set())
    return {module for module in modules if module == "accelgen" or module.startswith("accelgen.")}


def named_modules(path: Path) -> set[str]:
    """The accelgen modules a file names in strings, to import them at run time (the method table, whose modules the
    registry hands to importlib.import_module): a string that is a module's dotted name, and the package an
    f-string's literal start names (f"accelgen.nar.{name}" names accelgen.nar)."""
    named = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            text = str(node.values[0].value).rpartition(".")[0]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        else:
            continue
        if re.fullmatch(r"accelgen(\.\w+)+", text) and is_module(text):
            named.add(text)
    return named


def run_time_imports(path: Path) -> set[str]:
    """Everything a file imports: its import statements and the modules it names in strings, less those a lazy
    table may name (LAZY_TABLES)."""
    table_layer = LAZY_TABLES.get(module_name(path))
    named = {module for module in named_modules(path)
             if table_layer is None or LAYERS[LAYER_OF[top_level(module)]][0] != table_layer}
    return imported_modules(path) | named


def import_graph() -> dict[str, set[str]]:
    """module -> the accelgen modules it imports (run_time_imports), for every module of accelgen."""
    return {module_name(path): run_time_imports(path) for path in accelgen_files()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted: modules that import each other,
    directly or through others."""
    components = networkx.strongly_connected_components(networkx.DiGraph(
        [(module, imported) for module, imports in graph.items() for imported in imports]))
    return sorted(sorted(component) for component in components if len(component) > 1)


def accelgen_files() -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts)


def test_every_module_has_a_layer():
    assert sorted({top_level(module_name(path)) for path in accelgen_files()} - set(LAYER_OF)) == []


def test_the_table_names_existing_modules_once():
    names = [name for _, layer in LAYERS for name in layer]
    assert len(names) == len(set(names))
    assert [name for name in names if name != "__init__" and not is_module(f"accelgen.{name}")] == []


def test_no_module_imports_a_higher_layer():
    upward = []
    for path in accelgen_files():
        importer = top_level(module_name(path))
        for module in sorted(run_time_imports(path)):
            if LAYER_OF.get(top_level(module), -1) > LAYER_OF[importer]:
                upward.append(f"{path.relative_to(PACKAGE.parent)} ({LAYERS[LAYER_OF[importer]][0]}) imports "
                              f"{module} ({LAYERS[LAYER_OF[top_level(module)]][0]})")
    assert not upward, "\n".join(upward)


def test_the_check_sees_imports_inside_functions_and_relative_ones(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "PACKAGE", tmp_path / "accelgen")
    (tmp_path / "accelgen" / "models").mkdir(parents=True)
    for name in ("__init__.py", "cache.py", "models/__init__.py", "models/runner.py"):
        (tmp_path / "accelgen" / name).touch()
    source = tmp_path / "accelgen" / "models" / "batch.py"
    source.write_text("from accelgen import cache as kv\nfrom . import runner\n\n\n"
                      "def late():\n    import accelgen\n    from ..loop import generate\n    from accelgen import cache, x\n")
    assert imported_modules(source) == {"accelgen.cache", "accelgen.models.runner", "accelgen", "accelgen.loop"}


def test_no_modules_import_each_other_in_a_circle():
    assert circles(import_graph()) == []


def test_the_check_sees_modules_named_in_strings(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "PACKAGE", tmp_path / "accelgen")
    for name in ("__init__.py", "method_table.py", "cache.py", "drafters/__init__.py", "drafters/jacobi.py",
                 "train/__init__.py", "train/online.py", "nar/__init__.py"):
        (tmp_path / "accelgen" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "accelgen" / name).touch()
    (tmp_path / "accelgen" / "method_table.py").write_text(
        'TABLE = {"jacobi": "accelgen.drafters.jacobi", "online": "accelgen.train.online"}\n'
        'import importlib\n\n\ndef late(name):\n    importlib.import_module("accelgen.cache")\n'
        '    importlib.import_module(f"accelgen.nar.{name}")\n    return "accelgen is not a module name here"\n')
    path = tmp_path / "accelgen" / "method_table.py"
    assert named_modules(path) == {"accelgen.drafters.jacobi", "accelgen.train.online", "accelgen.cache",
                                   "accelgen.nar"}
    # the method table may name the methods layer, not the trainers above it
    assert run_time_imports(path) == {"accelgen.train.online", "accelgen.cache", "accelgen.nar"}


def test_circles_are_the_strongly_connected_components():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}, "g": {"g"}}
    assert circles(graph) == [["a", "b", "c"], ["d", "e"]]
