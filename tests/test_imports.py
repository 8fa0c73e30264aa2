"""The layering of the package: every module imports, imports flow one way, no cycles, and the layers-only
install needs none of the training or benchmark dependencies.

Levels, lowest first: ops <- layers <- models <- tiled <- predict <- {train, bench} <- experiments. A module may
import its own room and the rooms below it; ``train`` and ``bench`` never import each other.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement  # pytest's own dependency

import visattn

PACKAGE_DIR = Path(visattn.__file__).parent
REPO = PACKAGE_DIR.parent

# (room, level) by module-name prefix; the longest matching prefix wins.
ROOMS = {
    "visattn.ops": ("ops", 0),
    "visattn.layers": ("layers", 1),
    "visattn.models": ("models", 2),
    "visattn": ("models", 2),  # the package itself: it imports layers and models and registers the models with timm
    "visattn.tiled": ("tiled", 3),  # wraps a model; what predicts, trains or benchmarks may use it
    "visattn.predict": ("predict", 4),
    "visattn.train": ("train", 5),
    "visattn.bench": ("bench", 5),
    "visattn.experiments": ("experiments", 6),  # grids of training runs: may import train and bench
}
# Optional dependencies a lazy import may keep optional; any other import inside a function is an error.
OPTIONAL = {"matplotlib", "sklearn", "accelerate", "tensorboard"}
TRAINING_ONLY = ("accelerate", "matplotlib", "sklearn")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def _room(module: str) -> tuple[str, int]:
    prefix = max((p for p in ROOMS if module == p or module.startswith(p + ".")), key=len)
    return ROOMS[prefix]


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = importer if MODULES[importer].name == "__init__.py" else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _imports(module: str) -> list[tuple[str, bool, int]]:
    """(imported module, inside a function, line) for each import in ``module``; ``from pkg import sub`` names the
    submodule where ``sub`` is one."""
    tree = ast.parse(MODULES[module].read_text())
    found: list[tuple[str, bool, int]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, in_function, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(module, child)
                for alias in child.names:
                    target = f"{base}.{alias.name}"
                    found.append((target if target in MODULES else base, in_function, child.lineno))
            visit(child, nested)

    visit(tree, False)
    return found


def _internal_edges() -> dict[str, set[str]]:
    return {m: {t for t, _, _ in _imports(m) if t in MODULES and t != m} for m in MODULES}


def test_every_module_is_checked():
    assert len(MODULES) > 20
    assert {"visattn.ops", "visattn.layers", "visattn.models", "visattn.tiled", "visattn.train", "visattn.bench", "visattn.predict"} <= set(MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_flow_one_way(module):
    room, level = _room(module)
    for target, _, line in _imports(module):
        if target not in MODULES:
            continue
        target_room, target_level = _room(target)
        assert target_level < level or target_room == room, (
            f"{module}:{line} imports {target}: {room} (level {level}) may not import {target_room} (level {target_level})"
        )


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_inside_a_function_but_optional_dependencies(module):
    for target, in_function, line in _imports(module):
        if in_function:
            assert target.split(".")[0] in OPTIONAL, (
                f"{module}:{line} imports {target} inside a function; import it at the top of the module"
            )


def test_the_import_graph_has_no_cycle():
    edges = _internal_edges()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target] if target in path else [module, target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])


def test_every_module_imports_in_a_fresh_interpreter():
    names = sorted(MODULES)
    code = "import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in names)
    result = _run_python(code)
    assert result.returncode == 0, result.stderr[-3000:]


def test_layers_and_models_need_no_training_dependency():
    code = (
        "import sys, timm, torch\n"
        "import visattn, visattn.ops, visattn.layers, visattn.models, visattn.tiled, visattn.predict\n"
        "model = timm.create_model('visattn_vit_tiny_patch16', attn='linear', img_size=32, depth=1, num_classes=2)\n"
        "model(torch.zeros(1, 3, 32, 32))\n"
        f"print(sorted(m for m in {TRAINING_ONLY!r} if m in sys.modules))\n"
    )
    result = _run_python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_core_dependencies_leave_training_and_benchmark_to_extras():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {dep.split(">")[0].split("<")[0].split("=")[0].strip().lower() for dep in project["dependencies"]}
    assert not core & {"accelerate", "matplotlib", "scikit-learn", "tqdm"}
    extras = project["optional-dependencies"]
    assert any(dep.startswith("accelerate") for dep in extras["train"])
    assert any(dep.startswith("matplotlib") for dep in extras["bench"])



def test_declared_python_floor_has_the_standard_modules_the_code_and_tests_import():
    """tomllib is in the standard library from Python 3.11 on; a lower requires-python would promise an
    install whose tests cannot even be collected."""
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    floor = tuple(int(part) for part in requires.removeprefix(">=").split("."))
    importers = [path for path in (*REPO.joinpath("tests").rglob("*.py"), *PACKAGE_DIR.rglob("*.py"))
                 if any(isinstance(node, ast.Import) and any(a.name == "tomllib" for a in node.names)
                        for node in ast.walk(ast.parse(path.read_text())))]
    assert importers, "no module imports tomllib any more: the floor may come down"
    assert floor >= (3, 11), f"requires-python {requires!r}, but {importers[0]} imports tomllib (Python 3.11+)"


def test_installed_versions_meet_the_declared_floors():
    """The environment the tests run in is one the declared ranges allow."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = [Requirement(dep) for dep in (*project["dependencies"], *project["optional-dependencies"]["train"])]
    for requirement in declared:
        if requirement.name in {"torch", "torchvision", "timm", "accelerate"}:
            installed = version(requirement.name).split("+")[0]
            assert requirement.specifier.contains(installed), f"{requirement.name} {installed} outside {requirement}"
