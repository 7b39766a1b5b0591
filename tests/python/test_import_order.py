"""The modules of python/flashcpp import each other one way: no circle, counting the imports inside
functions too (a lazy import hides a circle from Python but not from a reader). Reads the source
with ast, so it runs without building the package; standard library only."""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "python" / "flashcpp"


def _imports(path: pathlib.Path, modules: set) -> set:
    """The package modules (file stems) that one module imports, anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module is None:  # from . import x, y
                found.update(a.name for a in node.names)
            elif node.level == 1:  # from .x import y
                found.add(node.module.split(".")[0])
            elif node.level == 0 and node.module and node.module.split(".")[0] == "flashcpp":
                parts = node.module.split(".")
                if len(parts) == 1:  # from flashcpp import x
                    found.update(a.name for a in node.names)
                    found.add("__init__")
                else:
                    found.add(parts[1])
            elif node.level > 1:  # from .. import: outside the package's top modules
                continue
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "flashcpp":
                    found.add(parts[1] if len(parts) > 1 else "__init__")
    return {m for m in found if m in modules}


def import_graph(package: pathlib.Path = PACKAGE) -> dict:
    files = {p.stem: p for p in sorted(package.glob("*.py"))}
    return {name: _imports(path, set(files)) - {name} for name, path in files.items()}


def find_circle(graph: dict):
    """One import circle as a list of modules (first == last), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                circle = visit(nxt)
                if circle:
                    return circle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            circle = visit(node)
            if circle:
                return circle
    return None


def test_no_import_circle():
    graph = import_graph()
    assert {"_core", "attention", "_torch_ops", "merge", "decode"} <= set(graph), sorted(graph)
    circle = find_circle(graph)
    assert circle is None, "import circle among python/flashcpp/*.py: " + " -> ".join(circle)


def test_public_modules_call_into_the_ops_module():
    graph = import_graph()
    for public in ("attention", "merge", "decode"):
        assert "_torch_ops" in graph[public], f"{public} should reach the torch ops through _torch_ops"
        assert public not in graph["_torch_ops"], f"_torch_ops imports {public} back"


@pytest.mark.parametrize("source, circle", [
    ({"a": "from . import b\n", "b": "def f():\n    from .a import g\n"}, ["a", "b", "a"]),
    ({"a": "from .b import x\n", "b": "from .c import y\n", "c": "import flashcpp.a\n"}, ["a", "b", "c", "a"]),
    ({"a": "from . import b\n", "b": "x = 1\n"}, None),
])
def test_circle_detection(tmp_path, source, circle):
    """The check itself: a function-level import that closes a circle is found, and a tree is not."""
    for name, text in source.items():
        (tmp_path / f"{name}.py").write_text(text)
    assert find_circle(import_graph(tmp_path)) == circle
