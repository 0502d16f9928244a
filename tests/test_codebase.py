"""The shape of the code, checked: every module says what it owns, every function fits on a page
(a module that grows past ~500 lines is reported, to be split by what it owns), imports never form
a cycle (function-level imports included), and the README stays a page."""

import ast
import pathlib
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"jinfer": ROOT / "jinfer", "jinfer_serve": ROOT / "serve"}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            found[name] = path
    return found


def _imports(name: str, path: pathlib.Path, modules) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(max(node.level - 1, 0)):
                base = base.rpartition(".")[0]
            module = node.module or ""
            prefix = f"{base}.{module}".strip(".") if node.level else module
            targets = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


# A function's lines past its docstring, nested functions included: about a page.
FUNCTION_LINES = 60
# Tables written as code, read row by row rather than as a flow: each check is one line.
LONG_TABLES = {
    "jinfer.config.EngineConfig.__post_init__",  # one check per engine setting
    "jinfer.sampling._validate",  # one check per sampling field
}
MODULE_LINES = 500  # past this a module is reported: split it by what it owns, never squeeze it


def _function_sizes(tree: ast.Module, module: str):
    """(qualified name, lines past the docstring) of every function in a module."""

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from visit(child, f"{prefix}.{child.name}")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = child.end_lineno - child.lineno + 1
                if ast.get_docstring(child) is not None:
                    lines -= child.body[0].end_lineno - child.body[0].lineno + 1
                yield f"{prefix}.{child.name}", lines
                yield from visit(child, f"{prefix}.{child.name}")

    yield from visit(tree, module)


def test_every_module_says_what_it_owns_and_every_function_fits_on_a_page():
    too_long, allowed_seen = [], set()
    for name, path in _modules().items():
        source = path.read_text()
        tree = ast.parse(source)
        if source.strip():
            assert ast.get_docstring(tree), f"{name} has no docstring saying what it owns"
        if (lines := len(source.splitlines())) > MODULE_LINES:
            warnings.warn(f"{name} has {lines} lines: split it by what it owns", stacklevel=1)
        for function, lines in _function_sizes(tree, name):
            if function in LONG_TABLES:
                allowed_seen.add(function)
            elif lines > FUNCTION_LINES:
                too_long.append(f"{function}: {lines} lines")
    assert too_long == []
    assert allowed_seen == LONG_TABLES, "the allow-list names a function that no longer exists"


def test_readme_is_a_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_the_wheel_lists_every_package():
    """pyproject.toml names its packages (the server folder installs under another name), so a
    new package folder must be added there or a plain `pip install` would lack it."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join((package, *path.parent.relative_to(folder).parts))
        for package, folder in PACKAGES.items()
        for path in folder.rglob("__init__.py")
    }
    assert listed == on_disk
