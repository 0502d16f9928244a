"""The shape of the code, checked: every module says what it owns, none grows past ~450 lines,
imports never form a cycle (function-level imports included), and the README stays a page."""

import ast
import pathlib

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


def test_every_module_has_a_docstring_and_stays_small():
    for name, path in _modules().items():
        source = path.read_text()
        if source.strip():
            assert ast.get_docstring(ast.parse(source)), f"{name} has no docstring saying what it owns"
        assert len(source.splitlines()) <= 460, f"{name}: {len(source.splitlines())} lines"


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
