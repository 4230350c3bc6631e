"""The shape of the code a newcomer reads: its largest classes and functions, and the
hand layouts kept from the formatter (``# fmt: skip``), per package.

    python -m benchmarks.code_shape [ROOT]

ROOT is a checkout (default: this one), so an older one can be measured the same way.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from typing import NamedTuple

PACKAGES = ("prefix_router", "router", "replica", "loadtest", "deploy")
#: A line the formatter is told to leave alone (the marker ends the line).
HAND_LAYOUT = re.compile(r"#\s*fmt:\s*skip\s*$", re.MULTILINE)


class Piece(NamedTuple):
    lines: int
    kind: str
    name: str
    where: str


def pieces(path: Path, root: Path) -> list[Piece]:
    """Every class and function of one file, with its length in lines."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            found.append(Piece(length, kind, node.name, f"{path.relative_to(root)}:{node.lineno}"))
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[0]).resolve() if argv else Path(__file__).resolve().parent.parent
    files = [f for package in PACKAGES for f in sorted((root / package).rglob("*.py"))]
    every = [piece for f in files for piece in pieces(f, root)]
    for kind in ("class", "function"):
        largest = sorted((p for p in every if p.kind == kind), reverse=True)[:5]
        print(f"largest {kind}es:" if kind == "class" else f"largest {kind}s:")
        for piece in largest:
            print(f"  {piece.lines:>4} lines  {piece.name}  ({piece.where})")
    lines = sum(len(f.read_text().splitlines()) for f in files)
    print(f"{len(files)} files, {lines} lines in {', '.join(PACKAGES)}")
    for folder in (*PACKAGES, "tests", "benchmarks"):
        files = (root / folder).rglob("*.py")
        skips = sum(len(HAND_LAYOUT.findall(f.read_text())) for f in files)
        print(f"  # fmt: skip in {folder}/: {skips}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
