"""The package's layout rules, checked from the source (no import runs): ``python scripts/check_layout.py``.

1. No import cycle between modules of ``hamo_ray``, counting imports inside functions too.
2. No arrow from a lower layer to a higher one (``LAYERS``: a module imports only modules of its layer
   or below).
3. At most ``MAX_TOP_LEVEL`` modules directly in ``hamo_ray/``; no module over ``MAX_LINES`` lines.

Exit status 1 and one line per violation when a rule is broken. ``tests/unit/test_layout.py`` runs it.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "hamo_ray"
MAX_TOP_LEVEL = 12
MAX_LINES = 400

# Layer of each module, by its longest matching name prefix (lowest first); see docs/architecture.md.
LAYERS = {
    "hamo_ray": 0,  # the package itself (its __init__)
    "hamo_ray.types": 0,
    "hamo_ray.logs": 0,
    "hamo_ray.chat": 0,
    "hamo_ray.config": 1,
    "hamo_ray.naming": 2,
    "hamo_ray.prompting": 3,  # composes the domains' own prompts (envs.prompts)
    "hamo_ray.evaluation": 2,
    "hamo_ray.neighbours": 3,
    "hamo_ray.selection": 3,
    "hamo_ray.envs": 3,
    "hamo_ray.memory": 3,
    "hamo_ray.backbones": 3,
    "hamo_ray.rollout": 4,
    "hamo_ray.serving": 4,
    "hamo_ray.training": 4,
    "hamo_ray.backbones.toy": 5,  # builds the toy backbone: trains it on distilled experience
    "hamo_ray.run": 6,
    "hamo_ray.sweep": 7,
}


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the ``hamo_ray`` modules it imports (at module level or inside functions)."""

    def resolve(name: str) -> str:
        while name and name not in mods:
            name = name.rsplit(".", 1)[0] if "." in name else ""
        return name

    edges: dict[str, set[str]] = defaultdict(set)
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Import):
                edges[m] |= {resolve(a.name) for a in node.names if a.name.startswith("hamo_ray")}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module or ""
                if name.startswith("hamo_ray"):
                    for a in node.names:
                        full = f"{name}.{a.name}"
                        edges[m].add(full if full in mods else resolve(name))
        edges[m].discard(m)
        edges[m].discard("")
    return edges


def cycles(edges: dict[str, set[str]], nodes: list[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                elif nxt in on:
                    low[v] = min(low[v], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def layer(module: str) -> int:
    best = max((k for k in LAYERS if module == k or module.startswith(k + ".")), key=len)
    return LAYERS[best]


def violations(root: Path = ROOT) -> list[str]:
    mods = modules(root)
    edges = import_graph(mods)
    out = [f"import cycle: {' <-> '.join(c)}" for c in cycles(edges, sorted(mods))]
    for m in sorted(edges):
        for dep in sorted(edges[m]):
            if layer(dep) > layer(m):
                out.append(f"upward import: {m} (layer {layer(m)}) imports {dep} (layer {layer(dep)})")
    top = sorted(p.name for p in root.glob("*.py"))
    if len(top) > MAX_TOP_LEVEL:
        out.append(f"{len(top)} modules directly in hamo_ray/ (at most {MAX_TOP_LEVEL}): {', '.join(top)}")
    for _m, p in sorted(mods.items()):
        n = len(p.read_text().splitlines())
        if n > MAX_LINES:
            out.append(f"{p.relative_to(root.parent)}: {n} lines (at most {MAX_LINES})")
    return out


def main() -> int:
    found = violations()
    for line in found:
        print(line)
    print(f"layout: {len(found)} violation(s)" if found else "layout: ok")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
