"""The package's layering (docs/architecture.md, "Layers"): imports go strictly downward, between
packages of one layer not at all, and no two modules import each other, directly or in a ring; no
module imports another module's private name (`from tether.x import _name`).

Every `import` / `from ... import` anywhere in a module counts, including those inside functions
(a lazy import still couples the two modules; it only hides the coupling until run time).
"""

from __future__ import annotations

import ast
from pathlib import Path

TETHER = Path(__file__).resolve().parent.parent / "tether"

# Layers, top (1) to bottom. A module may import from layers with a larger number, and from its
# own package (tether.<name>). Keep in step with docs/architecture.md, "Layers".
LAYERS = [
    ["studio"],  # `tether studio`: a web app over run directories and every layer below (it reads cli's COMMANDS)
    ["cli", "__main__"],
    ["serve"],  # `tether serve`: an OpenAI-compatible endpoint over chat's model loading and rollout/'s sampler
    ["studies", "init_model", "convert", "chat"],  # chat: `tether chat`, a terminal conversation over rollout/ and envs/
    ["quickstart"],  # below the studies: a study may start from the quickstart's policy (study prm)
    ["trainers", "labeling"],  # labeling: `tether label steps` (Math-Shepherd MC step labels)
    ["trajectories"],  # where the sampling trainers' scored batches come from: producers, the queue, its sources
    ["evaluation", "feedback"],  # held-out metrics (`tether eval`, eval points); AI feedback (judges, CAI)
    ["envs"],  # multi-turn environments and their tools (the episode loop in trajectories/ runs them)
    ["rollout", "rewards"],
    ["tasks"],
    ["models", "data"],
    ["objectives"],  # pure tensor functions: the models' log-prob forward uses them
    ["plots", "memory"],
    ["run", "model_shape"],
    ["distributed",  # torch.distributed: process group, sums over ranks, FSDP2, sharded optimizer state
     "model_card"],  # the README.md model card of checkpoints (RunDir.save_checkpoint writes it): plain data in, text out
    ["trackers"],  # experiment trackers behind RunDir (run.log_with): one adapter each for wandb, trackio, mlflow
    ["config", "errors"],
    ["constraints"],  # the allowed ranges of config values (config.py reads them)
]
LAYER_OF = {pkg: i + 1 for i, names in enumerate(LAYERS) for pkg in names}
# tether/__init__.py re-exports and may import anything: neither checked nor a target.
EXEMPT = {"tether"}
# `python -m tether` is the CLI's entry point: __main__.py and cli.py count as one package.
SAME_PACKAGE = {"__main__": "cli"}


# -- the import graph ---------------------------------------------------------------------------------

def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module name of a (possibly relative) `from X import ...`."""
    if not node.level:
        return node.module
    base = module.split(".")
    # level 1 means the package the module is in: for an __init__ that is the module itself
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(root: Path = TETHER) -> dict[str, list[tuple[str, int]]]:
    """module -> [(imported tether module, line)], for every module of the package at `root`.

    `import a.b.c` is an edge to a.b.c. `from P import x` is an edge to P (P's __init__ runs, and
    names come out of it) and, where P.x is a module, to P.x as well. So a submodule importing
    its own package (`from tether.objectives import x`) depends on everything that __init__
    imports, and is a cycle if the __init__ imports it back."""
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, list[tuple[str, int]]] = {}
    for mod, path in paths.items():
        is_package = path.name == "__init__.py"
        edges = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges += [(a.name, node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(node, mod, is_package)
                edges.append((target, node.lineno))
                edges += [(f"{target}.{a.name}", node.lineno) for a in node.names
                          if f"{target}.{a.name}" in paths]
        # only the package's own modules; an import of a missing one fails elsewhere, loudly
        graph[mod] = [(t, line) for t, line in edges if t in paths and t != mod]
    return graph


# -- the checks -----------------------------------------------------------------------------------------

def package_of(module: str) -> str:
    """tether.trainers.grpo.loop -> 'trainers'; tether.cli -> 'cli'; tether -> 'tether'."""
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else parts[0]
    return SAME_PACKAGE.get(name, name)


def layer_violations(graph, layer_of=LAYER_OF, exempt=EXEMPT) -> list[str]:
    """Every import that goes up, or sideways into another package of the same layer."""
    out = []
    for mod, edges in sorted(graph.items()):
        if mod in exempt:
            continue
        src = package_of(mod)
        if src not in layer_of:
            out.append(f"{mod}: package {src!r} has no layer (add it to LAYERS)")
            continue
        for target, line in edges:
            dst = package_of(target)
            if target in exempt or dst == src:
                continue
            if dst not in layer_of:
                out.append(f"{mod}:{line} -> {target}: package {dst!r} has no layer")
            elif layer_of[dst] <= layer_of[src]:
                how = "same layer" if layer_of[dst] == layer_of[src] else "upward"
                out.append(f"{mod}:{line} -> {target} ({how}: {src} is layer {layer_of[src]}, "
                           f"{dst} is layer {layer_of[dst]})")
    return out


def strongly_connected(graph) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative: no recursion limit to meet)."""
    succ = {m: sorted({t for t, _ in edges if t in graph}) for m, edges in graph.items()}
    index, low, on_stack, stack, comps, counter = {}, {}, set(), [], [], 0
    for start in sorted(succ):
        if start in index:
            continue
        work = [(start, iter(succ[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start), on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    comps.append(sorted(comp))
            elif nxt not in index:
                index[nxt] = low[nxt] = counter
                counter += 1
                stack.append(nxt), on_stack.add(nxt)
                work.append((nxt, iter(succ[nxt])))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
    return comps


def _cycle_through(start: str, comp: set[str], graph) -> list[str]:
    """A shortest import path start -> ... -> start inside one component (breadth first)."""
    parent, frontier = {}, [start]
    while frontier:
        nxt = []
        for m in frontier:
            for t, _ in graph[m]:
                if t not in comp:
                    continue
                if t == start:
                    path = [m]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start] + path[::-1][1:] + [start]
                if t not in parent:
                    parent[t] = m
                    nxt.append(t)
        frontier = nxt
    raise AssertionError(f"{start} is in a component but on no cycle")


def import_cycles(graph) -> list[str]:
    """One line per cyclic component: its shortest cycle through its first module, and its size."""
    out = []
    for comp in strongly_connected(graph):
        if len(comp) > 1:
            path = _cycle_through(comp[0], set(comp), graph)
            out.append(" -> ".join(path) + f"  ({len(comp)} modules in the cycle: {', '.join(comp)})")
    return out


def private_imports(root: Path = TETHER) -> list[str]:
    """Every `from tether.x import _name` (absolute or relative) of a private name of another
    module: a name with a leading underscore is its module's own; one used elsewhere is public."""
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    out = []
    for mod, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = _resolve(node, mod, path.name == "__init__.py")
            if target != root.name and not target.startswith(root.name + "."):
                continue
            out += [f"{mod}:{node.lineno} imports {a.name} from {target}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__") and target != mod]
    return out


# -- the tests --------------------------------------------------------------------------------------------

def test_imports_follow_the_layers():
    problems = layer_violations(import_graph())
    assert not problems, ("imports against the layering (docs/architecture.md, 'Layers'):\n  "
                          + "\n  ".join(problems))


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


def test_no_private_name_is_imported_across_modules():
    problems = private_imports()
    assert not problems, ("private names imported from another module (make them public):\n  "
                          + "\n  ".join(problems))


def test_the_private_import_check_finds_one(tmp_path):
    pkg = tmp_path / "tether"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("from .a import _f, g\n")
    (pkg / "low" / "a.py").write_text("def _f():\n    pass\ng = 1\n__all__ = ['g']\n")
    (pkg / "high.py").write_text("def h():\n    from tether.low.a import __all__, g\n")
    assert private_imports(pkg) == ["tether.low:1 imports _f from tether.low.a"]


def test_the_checker_finds_an_upward_import_and_a_cycle(tmp_path):
    # A fake package: lo imports hi (upward), hi imports lo back through the package __init__
    # (a cycle), and a lazy import inside a function must count too.
    pkg = tmp_path / "tether"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("from .a import f\n")
    (pkg / "low" / "a.py").write_text("def f():\n    from tether.high import g\n")
    (pkg / "low" / "b.py").write_text("from tether.errors import E\n")
    (pkg / "high.py").write_text("from tether.low import f\ng = 1\n")
    (pkg / "errors.py").write_text("E = 1\n")
    graph = import_graph(pkg)
    layers = {"high": 1, "low": 2, "errors": 3}

    problems = layer_violations(graph, layers)
    assert len(problems) == 1 and problems[0].startswith("tether.low.a:2 -> tether.high (upward")
    cycles = import_cycles(graph)
    assert cycles == ["tether.high -> tether.low -> tether.low.a -> tether.high"
                      "  (3 modules in the cycle: tether.high, tether.low, tether.low.a)"]

    # same-layer imports across packages and packages missing from the table are reported too
    layers.update(high=2)
    assert any("same layer" in p for p in layer_violations(graph, layers))
    assert any("has no layer" in p for p in layer_violations(graph, {"low": 2, "errors": 3}))

    # a relative import is resolved: `from .. import x` / `from .a import f` in an __init__
    assert ("tether.low.a", 1) in graph["tether.low"]
    assert graph["tether.low.b"] == [("tether.errors", 1)]
