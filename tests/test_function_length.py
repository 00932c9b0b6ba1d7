"""No function in src/ is longer than 120 lines (decorators and docstring included): a
function that long holds more than one idea and cannot be read as one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
LIMIT = 120


def long_functions(root: Path, limit: int = LIMIT) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                lines = node.end_lineno - first + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_in_src_is_over_the_limit():
    assert long_functions(SRC) == []


def test_the_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "long.py").write_text(f"@staticmethod\ndef long():\n{body}\n\ndef short():\n    return 1\n")
    assert long_functions(tmp_path) == [f"long.py:2 long ({LIMIT + 2} lines)"]


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
