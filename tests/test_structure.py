"""The layout's rules, checked on the source: the package's layers (import-linter's contract in pyproject.toml,
shown failing on a planted import), no import circle among the project's modules (imports inside functions count: a
lazy import does not remove a dependency), no module over 600 lines, no function outside the tests over 80, the
package never importing the root modules that are the roles and commands, and ruff clean."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from serverbench.backend.designs import DESIGNS as DESIGN_CLASSES
from serverbench.config.design_kinds import DESIGNS, experiment_label, is_design_label
from serverbench.config.door_options import DOOR_PACKAGES
from serverbench.config.limits import LOADGEN_MODULE

ROOT = Path(__file__).resolve().parent.parent
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80  # outside tests/: a longer function is split where a name explains the part
PACKAGES = ("serverbench", "bench", "tests")
# Roles and commands at the root: the package is their support code and never reaches back into them.
ROOT_ROLES = ("server", "client", "worker", "network_roles", "network_frontend", "door", "sweep", "report")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_files() -> dict[str, Path]:
    files = {module_name(path): path for path in ROOT.glob("*.py")}
    for package in PACKAGES:
        files.update({module_name(path): path for path in (ROOT / package).rglob("*.py")})
    return files


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports anywhere in its body, resolved to the most specific known module."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from package import module` names the module; `from module import function` names the module.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    files = project_files()
    known = set(files)
    return {name: imported_modules(name, path, known) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle as a path that ends where it starts, or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state:
                cycle = visit(dep)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_no_import_circle() -> None:
    cycle = find_cycle(import_graph())
    assert not cycle, "import circle: " + " -> ".join(cycle)


def test_circle_finder_finds_a_lazy_circle(tmp_path: Path) -> None:
    """The checker itself: a circle closed by an import inside a function is still a circle."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []
    source = tmp_path / "lazy.py"
    source.write_text("def f():\n    from serverbench.config import options\n    import metrics\n")
    assert imported_modules("lazy", source, {"serverbench.config.options", "metrics", "serverbench"}) == {
        "serverbench.config.options",
        "metrics",
    }


def test_modules_are_at_most_600_lines() -> None:
    long = {
        name: n_lines
        for name, path in project_files().items()
        if (n_lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def long_functions(name: str, source: str) -> dict[str, int]:
    """`module.function` -> its lines, for every function (methods and nested ones too) over MAX_FUNCTION_LINES."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            n_lines = node.end_lineno - node.lineno + 1
            if n_lines > MAX_FUNCTION_LINES:
                found[f"{name}.{node.name}"] = n_lines
    return found


def test_functions_outside_the_tests_are_at_most_80_lines() -> None:
    long = {}
    for name, path in project_files().items():
        if not name.startswith("tests"):
            long.update(long_functions(name, path.read_text(encoding="utf-8")))
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
    planted = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES  # the check itself: 81 lines are caught
    assert long_functions("m", planted) == {"m.f": MAX_FUNCTION_LINES + 1}


def test_package_never_imports_the_root_roles() -> None:
    graph = import_graph()
    reaching_back = {
        name: sorted(deps & set(ROOT_ROLES)) for name, deps in graph.items() if name.startswith("serverbench")
    }
    assert not {name: deps for name, deps in reaching_back.items() if deps}


def external_imports(path: Path) -> set[str]:
    """The top-level names of what a module imports from outside the project, anywhere in its body."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.partition(".")[0])
    return names


def reached_packages(start: str) -> set[str]:
    """Every outside package that `start` reaches through the project's modules, imports inside functions included."""
    graph, files = import_graph(), project_files()
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph[name])
    return set().union(*(external_imports(files[name]) for name in seen))


@pytest.mark.parametrize("role", ["worker", "client", "report"])
def test_the_core_roles_never_reach_the_optional_packages(role: str) -> None:
    """The backend and frontend over shm and queues, and the report, import none of the network door's packages
    nor LoadGen at any depth (network_roles.py and door.py do, for the runs that ask for them): a lent GPU machine
    without them runs every design. server.py reaches them only for --target's metadata, checked by
    tests/test_gpu_image.py at run time."""
    optional = set(DOOR_PACKAGES) | {LOADGEN_MODULE}
    assert reached_packages(role) & optional == set()
    assert reached_packages("network_roles") >= {"uvicorn", "orjson", "httptools", "tritonclient"}  # the check sees


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff_is_clean(command: list[str]) -> None:
    """Style cannot drift: the linter and the formatter configured in pyproject.toml run with the suite."""
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", *command], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"  # import-linter's command, beside this interpreter


def lint_imports(folder: Path) -> subprocess.CompletedProcess:
    """import-linter on the package in `folder` (its pyproject.toml holds the layers contract)."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(folder / "pyproject.toml"), "--no-cache"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(folder)},  # the copy's package, not the installed one
    )


def test_the_package_keeps_its_layers() -> None:
    """serverbench's packages import only downwards (the layers contract in pyproject.toml, by import-linter)."""
    proc = lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "1 kept, 0 broken" in proc.stdout


@pytest.mark.parametrize(
    ("module", "planted"),
    [
        ("config/limits.py", "from serverbench.launch import outcome"),  # a bottom layer reaching the top
        ("load/sender.py", "from serverbench.backend import batcher"),  # one sibling importing the other
        ("device/layer.py", "def f():\n    from serverbench.records import summary"),  # lazily, inside a function
    ],
    ids=["upward", "sibling", "lazy"],
)
def test_a_planted_import_against_the_layers_breaks_the_contract(tmp_path: Path, module: str, planted: str) -> None:
    """The contract can fail: the same check on a copy of the package with one import against the layers."""
    shutil.copytree(ROOT / "serverbench", tmp_path / "serverbench", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    assert lint_imports(tmp_path).returncode == 0  # the copy as it is keeps the contract
    target = tmp_path / "serverbench" / module
    target.write_text(target.read_text(encoding="utf-8") + f"\n{planted}\n", encoding="utf-8")
    proc = lint_imports(tmp_path)
    assert proc.returncode != 0 and "BROKEN" in proc.stdout, proc.stdout[-4000:]


def test_every_declared_design_has_its_class_and_one_label() -> None:
    """The designs are declared once (config/design_kinds.py); the backend's table serves exactly those, and every
    experiment label comes from one function that the report can read back."""
    assert list(DESIGN_CLASSES) == list(DESIGNS) and all(cls.kind.name == name for name, cls in DESIGN_CLASSES.items())
    assert [experiment_label(name, 3) for name in DESIGNS] == ["serial", "threaded", "pipelined_3w"]
    assert all(is_design_label(experiment_label(name, 4)) for name in DESIGNS)
    assert not any(map(is_design_label, ["pipelined_w", "pipelined", "serial_2w", "mine", "original"]))
