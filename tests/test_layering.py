"""The package's layering: app -> engine -> kernels, never back, and no import cycles.

Every import counts, at module level or inside a function (a deferred import is still a
dependency); only `if TYPE_CHECKING:` blocks are left out.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"app": 2, "engine": 1, "kernels": 0}          # a layer imports only lower ones


def _modules() -> dict[str, Path]:
    mods = {}
    for layer in LAYERS:
        for path in (ROOT / layer).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods["tritonchat." + ".".join(parts)] = path
    return mods


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(name: str, path: Path, mods: dict) -> set[str]:
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        for t in targets:
            # the longest known module the import names (a name imported from a module is that module)
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name and t != "tritonchat":
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _layer(mod: str) -> str:
    return mod.split(".")[1]


def test_layers_import_only_downwards():
    bad = [f"{a} imports {b}" for a, deps in _graph().items() for b in deps
           if LAYERS[_layer(b)] > LAYERS[_layer(a)]]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = _graph()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def strongconnect(v):                                   # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            strongconnect(v)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_imports():
    """Guard against a checker that passes because it finds nothing."""
    graph = _graph()
    assert "tritonchat.engine.options" in graph["tritonchat.engine.cli"]
    assert any(_layer(d) == "engine" for d in graph["tritonchat.app.worker"])
