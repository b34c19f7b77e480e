"""The import graph of torch_moe, by room, with the layering rules of the design checked.

    python tools/import_graph.py            # prints rooms, every edge, violations; exit 1 if any
    python tools/import_graph.py --dot      # Graphviz of the module graph

Reads the package's imports with ``ast`` (module level and inside functions, absolute and
relative), without importing anything. The rooms, lowest first, and the rule: a module imports
modules of its own room or of lower rooms only, and no two modules import each other through a
cycle. ``_refs`` is apart: it imports nothing of torch_moe but itself, so that a reference never
shares the code it checks, and nothing of the library imports it (the tests do).
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys
from typing import NamedTuple, Optional

PACKAGE = "torch_moe"

# (room, module prefixes), lowest first; the first matching prefix wins, so list the longer first
ROOMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("refs", ("torch_moe._refs",)),
    ("core", ("torch_moe._compat", "torch_moe._import_hook", "torch_moe._ops", "torch_moe._meta_registrations",
              "torch_moe._autograd", "torch_moe._checks", "torch_moe._functional_ops",
              "torch_moe._native", "torch_moe._triton")),
    ("quantization", ("torch_moe.quantization",)),
    ("inductor", ("torch_moe._inductor",)),
    ("nn", ("torch_moe.nn",)),
    ("distributed", ("torch_moe.distributed",)),
    ("package", ("torch_moe",)),
)
RANK = {name: i for i, (name, _) in enumerate(ROOMS)}


class Edge(NamedTuple):
    src: str
    dst: str
    line: int


def room_of(module: str) -> str:
    for name, prefixes in ROOMS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return name
    raise ValueError(f"{module} is in no room")


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _resolve(name: str, known: dict) -> Optional[str]:
    # "torch_moe.nn.functional.moe_ffn" -> "torch_moe.nn.functional"
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def edges(root: pathlib.Path) -> list[Edge]:
    known = modules(root)
    out = set()
    for module, path in known.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                if not (target == PACKAGE or target.startswith(PACKAGE + ".")):
                    continue
                dst = _resolve(target, known)
                if dst and dst != module:
                    out.add(Edge(module, dst, node.lineno))
    return sorted(out)


def violations(all_edges: list[Edge]) -> list[str]:
    bad = []
    for e in all_edges:
        a, b = room_of(e.src), room_of(e.dst)
        if a == "refs" and b != "refs":
            bad.append(f"reference shares code: {e.src}:{e.line} imports {e.dst}")
        elif b == "refs" and a != "refs":
            bad.append(f"library uses a reference: {e.src}:{e.line} imports {e.dst}")
        elif a != "package" and RANK[b] > RANK[a]:
            bad.append(f"upward import: {e.src} ({a}):{e.line} imports {e.dst} ({b})")
    bad.extend("cycle: " + " -> ".join(c + [c[0]]) for c in cycles(all_edges))
    return bad


def cycles(all_edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    graph: dict[str, set] = {}
    for e in all_edges:
        graph.setdefault(e.src, set()).add(e.dst)
        graph.setdefault(e.dst, set())
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parent.parent)
    parser.add_argument("--dot", action="store_true", help="print a Graphviz digraph instead")
    args = parser.parse_args(argv)
    known = modules(args.root)
    all_edges = edges(args.root)
    if args.dot:
        print("digraph torch_moe {\n  rankdir=BT;")
        for name, _ in ROOMS:
            members = [m for m in known if room_of(m) == name]
            print(f'  subgraph "cluster_{name}" {{ label="{name}"; '
                  + " ".join(f'"{m}";' for m in members) + " }")
        for src, dst in sorted({(e.src, e.dst) for e in all_edges}):
            print(f'  "{src}" -> "{dst}";')
        print("}")
        return 0
    by_src: dict[str, list] = {}
    for e in all_edges:
        by_src.setdefault(e.src, [])
        if e.dst not in by_src[e.src]:
            by_src[e.src].append(e.dst)
    for name, _ in ROOMS:
        members = [m for m in known if room_of(m) == name]
        print(f"[{name}] {len(members)} modules")
        for m in members:
            deps = ", ".join(f"{d.removeprefix(PACKAGE + '.')} ({room_of(d)})" for d in by_src.get(m, []))
            print(f"  {m.removeprefix(PACKAGE + '.') or PACKAGE}" + (f" -> {deps}" if deps else ""))
    bad = violations(all_edges)
    for b in bad:
        print(b)
    print(f"{len(known)} modules, {len({(e.src, e.dst) for e in all_edges})} imports, "
          f"{len(cycles(all_edges))} cycles, {len(bad)} violations")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
