"""The two sides of the package: the library (dmuon_edu outside course/) and the course above it.

The library depends on torch and tqdm only and never imports the course; inside the
library, imports run one way, down the floors listed in LIBRARY_FLOORS.
"""

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dmuon_edu"

# Lowest floor first: a library module may import only modules on the floors before its own.
LIBRARY_FLOORS = [
    ["arguments"],
    ["accumulation", "newton_schulz", "compare", "memory"],
    ["muon"],
    ["distributed", "launch"],
    ["checkpoint"],
    ["dmuon"],
]
# `python -m dmuon_edu` hands over to the course's command line: the one exempt file.
EXEMPT = {"__main__"}
COURSE_ONLY_TOOLS = ["matplotlib", "ipywidgets", "nbformat", "nbclient", "IPython", "jupyter"]
# Source for a subprocess (after `import importlib.abc, sys`): every course tool raises ModuleNotFoundError.
BLOCK_COURSE_TOOLS = f"""
class CourseToolsAbsent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == tool or name.startswith(tool) for tool in {COURSE_ONLY_TOOLS!r}):
            raise ModuleNotFoundError(f"No module named {{name!r}} (made unimportable by the test)")
        return None

sys.meta_path.insert(0, CourseToolsAbsent())
"""


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _library_files() -> list[Path]:
    return [path for path in sorted(PACKAGE.rglob("*.py"))
            if "course" not in path.relative_to(PACKAGE).parts and path.stem not in EXEMPT]


def _floor_of(module: str) -> str:
    """The library module a dotted name belongs to: dmuon_edu.dmuon.state -> dmuon; dmuon_edu -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _dmuon_edu_imports(path: Path, module: str | None = None) -> set[str]:
    """Every dmuon_edu module that ``path`` (the module named ``module``) imports, relative imports resolved."""
    module = module or _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module
            found.add(source)
            # `from dmuon_edu import dmuon` imports the module dmuon_edu.dmuon
            found |= {f"{source}.{alias.name}" for alias in node.names}
    return {name for name in found if name == "dmuon_edu" or name.startswith("dmuon_edu.")}


def test_the_library_imports_without_the_course_tools_and_loads_no_course_module():
    modules = [_module_name(path) for path in _library_files()]
    probe = f"""
import importlib, importlib.abc, sys

{BLOCK_COURSE_TOOLS}for module in {modules!r}:
    importlib.import_module(module)
course = sorted(m for m in sys.modules if m.startswith("dmuon_edu.course"))
tools = sorted(m for m in sys.modules if any(m.startswith(t) for t in {COURSE_ONLY_TOOLS!r}))
print("course modules loaded:", course)
print("course tools loaded:", tools)
sys.exit(1 if course or tools else 0)
"""
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(modules) >= 15, modules  # every library file was imported, not an empty list


def test_make_gpu_check_collects_its_tests_and_benchmarks_with_torch_pytest_and_tqdm_alone():
    # The GPU machine has its own torch, pytest and tqdm, and nothing else: make gpu-check installs
    # nothing, so its test files and the benchmark runner must not need a course tool.
    gpu_tests = re.search(r"^GPU_TESTS := (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1).split()
    probe = f"""
import importlib.abc, sys
import pytest

{BLOCK_COURSE_TOOLS}sys.path.insert(0, "benchmarks")
import run_all
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-m", "cuda", *{gpu_tests!r}]))
"""
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120,
                            env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"[1-9]\d* tests? collected", result.stdout), result.stdout  # the cuda tests were found


def test_library_imports_run_down_the_floors_and_never_up_into_the_course():
    floor_index = {module: i for i, floor in enumerate(LIBRARY_FLOORS) for module in floor}
    top_level = {_floor_of(_module_name(path)) for path in _library_files()} - {""}
    assert top_level == set(floor_index), "LIBRARY_FLOORS must list every library module once"
    for path in _library_files():
        own = _floor_of(_module_name(path))
        for imported in _dmuon_edu_imports(path):
            where = f"{path.relative_to(ROOT)} imports {imported}"
            assert not imported.startswith("dmuon_edu.course"), where + ": the library must not import the course"
            target = _floor_of(imported)
            if own == "" or target in ("", own):  # the package's own __init__ re-exports; a module its own parts
                continue
            assert floor_index[target] < floor_index[own], where + ", a module on the same floor or above it"


def test_the_import_scanner_sees_absolute_relative_and_upward_imports(tmp_path):
    # The floor test is only as good as its scanner: give it each kind of import, posing
    # as a file of dmuon_edu/dmuon/.
    probe = tmp_path / "probe.py"
    probe.write_text("from dmuon_edu.course import pitfalls\nfrom ..launch import torchrun\n"
                     "from . import plan\nimport dmuon_edu.muon\nfrom dmuon_edu import checkpoint\n")
    imports = _dmuon_edu_imports(probe, module="dmuon_edu.dmuon.probe")
    assert {"dmuon_edu.course", "dmuon_edu.launch", "dmuon_edu.dmuon.plan", "dmuon_edu.muon",
            "dmuon_edu.checkpoint"} <= imports


# Course vocabulary: the library's docstrings read like an API reference.
COURSE_WORDS = re.compile(
    r"\b[Mm]odule \d|\b[Ss]eed \d{3}\b|\b[Ss]eed's\b|\b[Ee]xercises?\b|\b[Ll]earners?\b|\b[Ll]essons?\b"
    r"|(?<!dmuon_edu\.)\b[Cc]ourse(?:'s)?\b"
)


def test_no_library_file_speaks_course_vocabulary():
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in _library_files()
             for number, line in enumerate(path.read_text().splitlines(), start=1)
             if COURSE_WORDS.search(line)]
    assert not found, "course vocabulary in the library:\n" + "\n".join(found)


def test_the_vocabulary_check_catches_each_kind_of_course_word():
    for line in ["as in module 6", "seed 000's loop", "the exercise", "a learner", "this lesson",
                 "how the course proves it"]:
        assert COURSE_WORDS.search(line), line
    for line in ["an nn.Module of layers", "dmuon_edu.course imports the library", "torch.manual_seed(0)"]:
        assert not COURSE_WORDS.search(line), line


def test_the_library_depends_on_torch_and_tqdm_only_and_the_course_tools_are_an_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = sorted(re.split(r"[<>=!~ ;\[]", requirement)[0] for requirement in project["dependencies"])
    assert names == ["torch", "tqdm"]
    course = {re.split(r"[<>=!~ ;\[]", r)[0] for r in project["optional-dependencies"]["course"]}
    assert {"jupyterlab", "ipywidgets", "matplotlib", "nbformat", "nbclient"} <= course


def _import_graph() -> dict[str, set[str]]:
    """Module -> the dmuon_edu modules it imports anywhere (top level or inside a function), ancestors left out:
    importing a submodule imports its packages first, whoever imports whom."""
    files = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
    graph = {}
    for module, path in files.items():
        ancestors = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
        graph[module] = {name for name in _dmuon_edu_imports(path, module) if name in files} - ancestors - {module}
    return graph


def _a_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state = {}  # module -> "open" while on the path being explored, "done" after

    def visit(module, path):
        state[module] = "open"
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return path[path.index(imported):] + [imported]
            if imported not in state and (found := visit(imported, path + [imported])):
                return found
        state[module] = "done"
        return None

    return next((found for module in sorted(graph) if module not in state and (found := visit(module, [module]))), None)


def test_no_module_of_the_package_imports_itself_through_others():
    # A circle works only while every import in it stays lazy, inside a function: one more top-level
    # import, and whichever module loads first fails half-initialised.
    circle = _a_cycle(_import_graph())
    assert circle is None, " -> ".join(circle)


def test_the_cycle_finder_finds_a_circle_and_only_one():
    assert _a_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _a_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


# dmuon's internals read in an afternoon: no class over about 150 lines, no function over about 60, docstrings aside.
MOST_LINES = {"class": 150, "function": 60}


def _sizes(source: str) -> dict[str, tuple[str, int]]:
    """{qualified name: ("class" or "function", its lines less every docstring inside it)} of a module's source."""
    sizes = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = [d for d in ast.walk(child)
                         if isinstance(d, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
                docstrings = [d.body[0] for d in inner if d.body and isinstance(d.body[0], ast.Expr)
                              and isinstance(d.body[0].value, ast.Constant) and isinstance(d.body[0].value.value, str)]
                lines = child.end_lineno - child.lineno + 1 - sum(d.end_lineno - d.lineno + 1 for d in docstrings)
                sizes[prefix + child.name] = ("class" if isinstance(child, ast.ClassDef) else "function", lines)
                visit(child, prefix + child.name + ".")
    visit(ast.parse(source), "")
    return sizes


def test_no_class_or_function_of_dmuon_outgrows_a_reading():
    too_long = [f"{path.name}: {kind} {name}, {lines} lines"
                for path in sorted((PACKAGE / "dmuon").glob("*.py"))
                for name, (kind, lines) in _sizes(path.read_text()).items() if lines > MOST_LINES[kind]]
    assert too_long == [], "split these by job (one job per class or function): " + "; ".join(too_long)


def test_the_size_count_leaves_docstrings_out_and_sees_methods():
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    source = f'class A:\n    """Doc\n\n    more."""\n\n    def long(self):\n        """Doc."""\n{body}\n'
    sizes = _sizes(source.replace("\n    x", "\n        x"))
    assert sizes["A.long"] == ("function", 62) and sizes["A"] == ("class", 64), sizes
