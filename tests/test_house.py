"""House rules that a reader relies on: no function in mega/ longer than 80 lines unless its
docstring says why ("long because ...")."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 80


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from _functions(node, f"{name}.")
        else:
            yield from _functions(node, prefix)


def long_functions() -> dict[str, int]:
    """``path:qualname`` -> lines (``def`` to last line) of each over-long function in mega/
    whose docstring does not say why it is long."""
    found = {}
    for path in sorted((ROOT / "mega").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for name, node in _functions(tree):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_LINES and "long because" not in (ast.get_docstring(node) or ""):
                found[f"{path.relative_to(ROOT)}:{name}"] = lines
    return found


def test_functions_in_mega_are_short_or_say_why():
    found = long_functions()
    assert not found, (
        f"longer than {MAX_LINES} lines (split, or say in the docstring why it is long): {found}"
    )


def test_the_length_check_sees_a_long_function(tmp_path):
    """The check counts what a reader sees: a function of 81 lines is reported, one that says why
    is not."""
    body = "".join(f"    x{i} = {i}\n" for i in range(79))
    source = (
        f'def long():\n    """A function."""\n{body}\n\ndef ok():\n    """long because: a table."""\n{body}'
    )
    tree = ast.parse(source)
    lengths = {name: node.end_lineno - node.lineno + 1 for name, node in _functions(tree)}
    assert lengths == {"long": 81, "ok": 81}
    docs = {name: ast.get_docstring(node) for name, node in _functions(tree)}
    assert "long because" in docs["ok"] and "long because" not in docs["long"]
