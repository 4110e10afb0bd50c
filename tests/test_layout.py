"""The architecture the package layout shows, kept by a test: the model layer (`diffusion`:
pure JAX and numpy) imports nothing of the farm and no queue or storage client; the shared
contracts (`renderfarm`) import neither side, only the model layer's names and error (its
JAX-free modules); producers never import the worker, only the entry point (`renderfarm_cli`)
wires both sides, and no module imports itself back through others. Every import counts, the
ones inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("renderfarm", "producer", "diffusion", "worker", "renderfarm_cli")
# package -> the packages it must not import
FORBIDDEN = {"renderfarm": {"producer", "worker", "renderfarm_cli"},
             "producer": {"diffusion", "worker", "renderfarm_cli"},
             "diffusion": {"renderfarm", "producer", "worker", "renderfarm_cli"},
             "worker": {"producer", "renderfarm_cli"}}
# What the contracts read of the model layer: its names and its error, modules without JAX.
CONTRACT_MAY_IMPORT = {"diffusion.choices", "diffusion.errors"}
# What those modules may import beyond each other: the standard library's, nothing that loads JAX or numpy.
LIGHT_LIBRARIES = {"__future__", "re", "reprlib", "typing"}
# Queue, broker and storage clients, which the model layer never imports.
FARM_LIBRARIES = {"celery", "kombu", "redis", "redbeat", "flower", "google", "prometheus_client", "pyarrow"}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def libraries(path: Path) -> set[str]:
    """The top-level names of everything `path` imports absolutely (project packages too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `name` imports (a `from package import module` counts as the
    module; anything else as the deepest project module named)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in edges[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in edges:
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_a_side_it_must_not() -> None:
    bad = [f"{name} imports {target}" for name, targets in graph().items() for target in sorted(targets)
           if target.split(".")[0] in FORBIDDEN.get(name.split(".")[0], ())]
    assert bad == []


def test_the_model_layer_stands_alone() -> None:
    """diffusion/ is usable without the farm: nothing of the farm (renderfarm, worker), and no
    queue, broker or storage client, however deep the import."""
    known = modules()
    edges = graph()
    farm = [f"{name} imports {target}" for name in edges if name.split(".")[0] == "diffusion"
            for target in sorted(edges[name]) if target.split(".")[0] in ("renderfarm", "worker")]
    clients = [f"{name} imports {library}" for name, path in known.items() if name.split(".")[0] == "diffusion"
               for library in sorted(libraries(path) & FARM_LIBRARIES)]
    assert farm == [] and clients == []
    assert {name for name in known if name.startswith("diffusion.")} >= {
        "diffusion.models", "diffusion.nn.unet", "diffusion.schedulers", "diffusion.generate"}


def test_the_contracts_read_the_model_layer_without_jax() -> None:
    """renderfarm/ (which the producer imports) reads only the model layer's names and error,
    and those modules import nothing but each other and a few standard modules."""
    known = modules()
    edges = graph()
    read = {target for name in edges if name.split(".")[0] == "renderfarm"
            for target in edges[name] if target.split(".")[0] == "diffusion"}
    assert read == CONTRACT_MAY_IMPORT
    heavy = {name: sorted(libraries(known[name]) - LIGHT_LIBRARIES - {"diffusion"}) for name in CONTRACT_MAY_IMPORT}
    assert all(edges[name] <= CONTRACT_MAY_IMPORT for name in CONTRACT_MAY_IMPORT) and not any(heavy.values())


def test_the_benchmarks_never_import_the_tests() -> None:
    """What bench/ shares with the tests (real farm processes, tokenizer folders) lives in
    harness/, which both import; the tests are not a library, and none of harness/ leans on
    them either."""
    bad = [f"{path.relative_to(ROOT)} imports tests" for folder in ("bench", "harness")
           for path in sorted((ROOT / folder).rglob("*.py")) if "tests" in libraries(path)]
    assert bad == []


def test_no_import_cycles() -> None:
    assert cycles(graph()) == []


def test_the_checks_see_what_they_check() -> None:
    """A cycle and a forbidden import are found when they are there (the walk is not blind)."""
    edges = graph()
    assert "renderfarm.jobs" in edges["renderfarm.ingest"]  # a plain import
    assert "worker.engine" in edges["worker.commands"]  # an import inside a function
    assert "diffusion.families.sd" in edges["diffusion.families"]  # `from package import module`
    assert "google" in libraries(ROOT / "renderfarm" / "storage" / "gcs.py")  # a client library
    assert "jax" in libraries(ROOT / "diffusion" / "generate.py")
    assert "tests" in libraries(ROOT / "tests" / "test_tokenizer.py")
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
