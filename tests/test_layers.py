"""autopart's layers import downward only, lazily only where named, and keep no module state.

Every module under ``autopart/`` and ``passes/`` (installed as ``autopart.passes``) is parsed with
``ast`` (nothing is imported) and assigned a layer by ``LAYERS`` below, lowest first; the order and
what each layer is for are in docs/architecture.md ("Layers"). The checks:

(a) an import at module level goes to the module's own layer or a lower one; a function-level
    import too (being lazy does not excuse a back-edge), and a ``TYPE_CHECKING`` import to a
    higher layer only when ``TYPE_ONLY`` names it with its reason;
(b) outside ``autopart/cli/`` (the command line imports each subcommand's machinery when it
    runs), an ``autopart`` import inside a function, or an ``importlib.import_module`` call, only
    when ``LAZY`` names it with its reason;
(c) every entry of ``LAZY``, ``TYPE_ONLY``, ``REGISTRIES`` and ``PROCESS_STATE`` still matches
    something, so the lists cannot go stale;
(d) a module-level (or class-level) list, dict or set (a display, a comprehension, or a call of
    ``list``, ``dict``, ``set``, ``defaultdict``, ...) only for a name of ``REGISTRIES`` (tables built at import,
    which no code writes afterwards: checked) or ``PROCESS_STATE``; no function rebinds a module
    name (``global``). ``__all__`` is exempt. Constant sets are ``frozenset``s, sequences tuples.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# (layer, module prefixes, what it is for), lowest first. A module belongs to the layer of the
# longest prefix it matches ("autopart" itself: the package's __init__ only).
LAYERS: list[tuple[str, tuple[str, ...], str]] = [
    (
        "base",
        (
            "autopart.errors",
            "autopart.process",
            "autopart.meta",
            "autopart.node_args",
            "autopart.graph",
        ),
        "the error type and wait, the process as first seen, metadata keys, typed node "
        "arguments, fx graph utilities",
    ),
    (
        "schedule",
        ("autopart.schedule",),
        "schedules as data: actions, generators, verifier, chunks",
    ),
    ("layout", ("autopart.layout",), "Mesh and Plan, checked against the schedules' rules"),
    (
        "graph ops",
        ("autopart.collectives", "autopart.deferred", "autopart.scan"),
        "collectives, deferred GEMMs and the linear scan as custom ops: passes (and capture) "
        "insert them, the runtime runs them",
    ),
    ("frontend", ("autopart.frontend",), "capture and cost: a model becomes a Captured graph"),
    ("passes", ("autopart.passes",), "graph-to-graph rewrites, one invariant each"),
    (
        "program",
        ("autopart.program",),
        "the compiled Program's types and files: what lowering emits and the runtime loads",
    ),
    ("lowering", ("autopart.lowering",), "compile_program: passes, stages, schedules, dry run"),
    ("runtime", ("autopart.runtime",), "runs one rank's program; launch, checkpoints, traces"),
    ("api", ("autopart.api",), "parallelize: capture and compile, a Runner for a live mesh"),
    (
        "beside the flow",
        ("autopart.parity", "autopart.planning"),
        "verify and plan: read the flow, never read by it",
    ),
    ("models", ("autopart.models",), "the demo model and the zoo (whose matrix runs verify)"),
    (
        "entry points",
        ("autopart.cli", "autopart.__main__", "autopart"),
        "the command line and the package's lazy front door",
    ),
]

DYNAMIC = "<dynamic>"  # an importlib.import_module call whose module is not a literal

# (file, module it imports inside a function) → why it is not imported at module level
LAZY: dict[tuple[str, str], str] = {
    ("autopart/__main__.py", "autopart.cli"): "the CLI's imports (torch) run inside run(), "
    "so that a Ctrl-C during them ends it in one line, not a traceback",
    ("autopart/__init__.py", DYNAMIC): "PEP 562: `import autopart` imports errors only; each "
    "name imports its module on first use, so a rank running a saved program imports no "
    "compiler or verifier",
    ("autopart/frontend/spec.py", DYNAMIC): "loads the user's model SPEC (`module:make`) by name",
    ("autopart/program/libraries.py", DYNAMIC): "imports a library the loading user trusts "
    "(by name, after its version is checked) so that its custom ops exist",
    ("autopart/api.py", "autopart.runtime.runner"): "an offline compile (an autopart.Mesh) "
    "imports no runtime; only a live DeviceMesh gets a Runner",
    ("autopart/api.py", "autopart.runtime.guards"): "as the runner: only a module a live "
    "runner follows can be behind it",
    ("autopart/api.py", "autopart.runtime.meet"): "as the runner: only a live mesh's model "
    "broadcast meets the other ranks first",
    ("autopart/api.py", "autopart.runtime.handover"): "as the runner: only a live mesh whose "
    "rank 0 compiles for the others hands programs over",
    ("autopart/runtime/run.py", "autopart.runtime.checkpoint"): "torch.distributed.checkpoint "
    "adds about 1 s to every rank's start; only --checkpoint-dir needs it",
    ("autopart/planning/simulate/shape.py", "autopart.frontend.capture"): "the simulator and "
    "the planner import no torch (named shapes, shape flags); a captured model or a SPEC does",
    ("autopart/planning/simulate/shape.py", "autopart.frontend.cost"): "as frontend.capture: "
    "only a captured model's shape is read off its cost",
    ("autopart/planning/simulate/shape.py", "autopart.frontend.spec"): "as frontend.capture: "
    "only --model SPEC builds a model",
}

# (file, module) of a `if TYPE_CHECKING:` import that goes to a higher layer → why
TYPE_ONLY: dict[tuple[str, str], str] = {
    ("autopart/collectives.py", "autopart.runtime.comm"): "the type of the active context "
    "(activate(comm)); at run time the ops import nothing from the runtime, which activates its "
    "Comm",
}

# (file, name) of a module-level container built at import and never written afterwards → what
REGISTRIES: dict[tuple[str, str], str] = {
    ("autopart/__init__.py", "_LAZY"): "public name → its module, for PEP 562",
    ("autopart/__init__.py", "_MODULES"): "public submodule → its module, for PEP 562",
    ("autopart/meta.py", "KEYS"): "every META_ key, gathered once (tests/test_meta.py)",
    ("autopart/schedule/generators.py", "GENERATORS"): "schedule name → generator",
    ("autopart/schedule/generators.py", "TRAITS"): "schedule name → its traits",
    ("autopart/schedule/verify.py", "_MATCH"): "receive kind → its send kind",
    ("autopart/frontend/capture.py", "_SPLIT_UP"): "op → the decomposition capture applies",
    ("autopart/frontend/capture.py", "LIBRARY_DECOMPOSITIONS"): "library op → its ATen "
    "decomposition (documented as the place to add one)",
    ("autopart/frontend/shapes.py", "_SYMBOLIC"): "size op → how it is recomputed",
    ("passes/seq_rules.py", "_ALONG"): "op → the dims it works along (sequence rules)",
    ("passes/seq_rules.py", "_FULLS"): "full op → where its fill value is",
    ("passes/seq_rules.py", "_SPECIAL"): "op → its sequence rule",
    ("passes/seq_rules.py", "_CARRIED_SCANS"): "running-scan op → its name",
    ("passes/seq_rules.py", "_ROWS"): "op → its rule with the batch in the sequence's place",
    ("passes/seq_rules.py", "SIZE_ARGS"): "op → its size arguments",
    ("passes/position_masks.py", "_LENGTH_ARGS"): "op → where a mask's construction may read "
    "the sequence length",
    ("passes/position_masks.py", "_DIMS_AT"): "op → where it names its dims",
    ("passes/tp_rules.py", "RULES"): "op → its tensor-parallel rule",
    ("autopart/program/format.py", "_DTYPES"): "dtype name → dtype, for the loader",
    ("autopart/program/graph_json.py", "_LEAF"): "the pytree leaf spec a stage archive holds",
    ("autopart/program/plan_json.py", "PLAN_FIELDS"): "plan.json's schema",
    ("autopart/runtime/copies.py", "_BITS"): "byte width → integer dtype",
    ("autopart/parity/verify.py", "TOLERANCE"): "dtype → verify's tolerance",
    ("autopart/parity/verify.py", "DTYPES"): "dtype name → dtype",
    ("autopart/parity/verify.py", "_PLAN_WORDS"): "--plans word → Plan field",
    ("autopart/planning/cluster.py", "PRESETS"): "cluster name → profile",
    ("autopart/planning/planner.py", "_CATS"): "summary field → breakdown category",
    ("autopart/planning/simulate/events.py", "_MATCH"): "receive kind → its send kind",
    ("autopart/planning/simulate/shape.py", "SHAPES"): "model shape name → GPTShape",
    ("autopart/models/zoo.py", "COMMON"): "the zoo's common config sizes",
    ("autopart/models/zoo.py", "_MLA"): "the config of multi-head latent attention",
    ("autopart/models/zoo.py", "ARCHITECTURES"): "architecture → what it brings, its config",
    ("autopart/models/zoo.py", "PLANS"): "the compatibility matrix's columns",
    ("autopart/cli/__init__.py", "COMMANDS"): "subcommand → its module",
    ("autopart/cli/common.py", "MODEL_DEFAULTS"): "flag → its default",
    ("autopart/cli/simulate.py", "DEFAULTS"): "flag → its default",
    ("autopart/cli/common.py", "_FLAG_TYPES"): "a Plan field's type → its flag's type",
    ("autopart/cli/report.py", "_COLLECTIVES"): "collective → its line in the report",
    ("autopart/runtime/runner.py", "Runner._HANDLERS"): "action kind → the method that runs it",
}

# (file, name) of module-level state that changes at run time → why it must be process-wide
PROCESS_STATE: dict[tuple[str, str], str] = {
    ("autopart/collectives.py", "_ACTIVE"): "which runtime context (a Runner's Comm) the graph "
    "ops use, as torch keeps a default process group: process-wide because the autograd engine "
    "runs the ops' backwards on its own threads; written by activate() only",
    ("autopart/process.py", "_SIGINTS"): "the SIGINTs this process received: a signal is "
    "process-wide, and C code can drop its KeyboardInterrupt; written by the handler only",
}

_CONTAINER_CALLS = frozenset(
    {"list", "dict", "set", "defaultdict", "OrderedDict", "Counter", "deque"}
)
_MUTATORS = frozenset(
    {"append", "extend", "insert", "add", "update", "setdefault", "pop", "popitem", "clear"}
    | {"remove", "discard", "sort", "reverse", "__setitem__", "__delitem__"}
)


@dataclass(frozen=True)
class Import:
    path: str  # relative to the repository
    line: int
    target: str  # an autopart module, or DYNAMIC
    where: str  # "module", "function" or "type"


@dataclass(frozen=True)
class Module:
    name: str
    path: str
    source: str
    tree: ast.Module


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[0] == "passes":
        parts = ["autopart", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def load_modules() -> dict[str, Module]:
    out = {}
    for p in sorted(
        [*REPO.joinpath("autopart").rglob("*.py"), *REPO.joinpath("passes").rglob("*.py")]
    ):
        source = p.read_text()
        out[module_name(p)] = Module(
            module_name(p), p.relative_to(REPO).as_posix(), source, ast.parse(source, str(p))
        )
    return out


def layer_of(name: str) -> int | None:
    best: tuple[int, int] | None = None
    for i, (_, prefixes, _) in enumerate(LAYERS):
        for p in prefixes:
            hit = name == p or (p != "autopart" and name.startswith(p + "."))
            if hit and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return None if best is None else best[0]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(body: list[ast.stmt], where: str) -> Iterator[tuple[ast.stmt, str]]:
    """Every statement under ``body`` with where it runs: "module" (at import), "type" (under
    ``if TYPE_CHECKING:``) or "function". Expressions are not entered: imports are statements."""
    for s in body:
        yield s, where
        inner = "function" if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
        if isinstance(s, ast.If) and where == "module" and _is_type_checking(s.test):
            yield from _statements(s.body, "type")
            yield from _statements(s.orelse, where)
            continue
        for field in ("body", "orelse", "finalbody"):
            yield from _statements(getattr(s, field, []), inner)
        for h in getattr(s, "handlers", []):
            yield from _statements(h.body, inner)
        for c in getattr(s, "cases", []):
            yield from _statements(c.body, inner)


def imports_of(mod: Module, known: set[str]) -> list[Import]:
    """Every autopart import of ``mod``: module level, inside a function, or type-only; and
    every ``import_module`` call (inside a function: none is at module level)."""
    package = mod.name if mod.path.endswith("__init__.py") else mod.name.rpartition(".")[0]
    out: list[Import] = []
    for s, where in _statements(mod.tree.body, "module"):
        if isinstance(s, ast.Import):
            targets = [a.name for a in s.names]
        elif isinstance(s, ast.ImportFrom):
            base = s.module or ""
            if s.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - s.level + 1], *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in s.names]
        else:
            continue
        for t in targets:
            if t == "autopart" or t.startswith("autopart."):
                out.append(Import(mod.path, s.lineno, t, where))
    if (
        "import_module" in mod.source
    ):  # importlib.import_module(...): an expression, found by walking
        for node in ast.walk(mod.tree):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            f = node.func
            name = (
                f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            )
            arg = node.args[0]
            if name == "import_module":
                literal = isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                target = str(arg.value) if isinstance(arg, ast.Constant) and literal else DYNAMIC
                if target == DYNAMIC or target.startswith("autopart"):
                    out.append(Import(mod.path, node.lineno, target, "function"))
    return out


def module_containers(mod: Module) -> list[tuple[str, int]]:
    """(name, line) of every mutable container assigned at module level or in a class body
    (``Class.name``: shared by every instance, module state all the same)."""

    def mutable(v: ast.expr | None) -> bool:
        if isinstance(v, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
            return True
        if isinstance(v, ast.Call):
            f = v.func
            name = (
                f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            )
            return name in _CONTAINER_CALLS
        return False

    out: list[tuple[str, int]] = []

    def walk(body: list[ast.stmt], prefix: str) -> None:
        for s in body:
            if isinstance(s, ast.ClassDef):
                walk(s.body, f"{prefix}{s.name}.")
                continue
            if isinstance(s, (ast.If, ast.Try, ast.With)):
                for block in ("body", "orelse", "finalbody"):
                    walk(getattr(s, block, []), prefix)
                for h in getattr(s, "handlers", []):
                    walk(h.body, prefix)
                continue
            if isinstance(s, ast.Assign):
                targets, value = s.targets, s.value
            elif isinstance(s, ast.AnnAssign):
                targets, value = [s.target], s.value
            else:
                continue
            if mutable(value):
                for t in targets:
                    out.extend(
                        (prefix + n.id, s.lineno) for n in ast.walk(t) if isinstance(n, ast.Name)
                    )

    walk(mod.tree.body, "")
    return [(name, line) for name, line in out if name != "__all__"]


def writes_of(mod: Module, names: set[str]) -> list[tuple[str, int]]:
    """(name, line) where ``mod`` writes into one of ``names`` (``x[k] = v``, ``x[k] += v``,
    ``del x[k]``, ``x.append(...)`` and the other mutating methods, also as ``module.x``), and
    every ``global`` statement."""

    def named(e: ast.expr) -> str | None:
        if isinstance(e, ast.Name) and e.id in names:
            return e.id
        if isinstance(e, ast.Attribute) and e.attr in names:
            return e.attr
        return None

    out: list[tuple[str, int]] = []
    for s, _ in _statements(mod.tree.body, "module"):  # assignments are statements
        if isinstance(s, ast.Global):
            out += [(f"global {n}", s.lineno) for n in s.names]
        elif isinstance(s, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = s.targets if isinstance(s, (ast.Assign, ast.Delete)) else [s.target]
            stack = list(targets)
            while stack:  # x[k] = v, x[k][j] = v (into x's entry), (a, x[k]) = v
                t = stack.pop()
                if isinstance(t, (ast.Tuple, ast.List)):
                    stack.extend(t.elts)
                elif isinstance(t, ast.Starred):
                    stack.append(t.value)
                elif isinstance(t, ast.Subscript):
                    if (n := named(t.value)) is not None:
                        out.append((n, s.lineno))
                    stack.append(t.value)
    held, verbs = "|".join(sorted(names)), "|".join(sorted(_MUTATORS))
    if re.search(rf"\b(?:{held})\s*\.\s*(?:{verbs})\s*\(", mod.source):  # calls: walk only here
        for node in ast.walk(mod.tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in _MUTATORS
                and (n := named(node.func.value)) is not None
            ):
                out.append((n, node.lineno))
    return sorted(out, key=lambda x: x[1])


@pytest.fixture(scope="module")
def modules() -> dict[str, Module]:
    return load_modules()


@pytest.fixture(scope="module")
def imports(modules: dict[str, Module]) -> list[Import]:
    known = set(modules)
    return [i for m in modules.values() for i in imports_of(m, known)]


def back_edges(imports: list[Import], modules: dict[str, Module]) -> list[str]:
    by_path = {m.path: m for m in modules.values()}
    found = []
    for i in imports:
        if i.target == DYNAMIC or (i.where == "type" and (i.path, i.target) in TYPE_ONLY):
            continue
        src, dst = layer_of(by_path[i.path].name), layer_of(i.target)
        if src is not None and dst is not None and dst > src:
            found.append(
                f"{i.path}:{i.line} ({LAYERS[src][0]}) imports {i.target} ({LAYERS[dst][0]})"
                + (" inside a function" if i.where == "function" else "")
                + (" for types only (not in TYPE_ONLY)" if i.where == "type" else "")
            )
    return found


def unnamed_lazy(imports: list[Import]) -> list[str]:
    return [
        f"{i.path}:{i.line} imports {i.target} inside a function"
        for i in imports
        if i.where == "function"
        and not i.path.startswith("autopart/cli/")
        and (i.path, i.target) not in LAZY
    ]


def test_every_module_has_a_layer(modules: dict[str, Module]) -> None:
    missing = [f"{m.path} ({m.name})" for m in modules.values() if layer_of(m.name) is None]
    assert not missing, "modules in no layer of LAYERS (add their package):\n" + "\n".join(missing)


def test_no_import_goes_to_a_higher_layer(
    imports: list[Import], modules: dict[str, Module]
) -> None:
    found = back_edges(imports, modules)
    assert not found, "imports against the layer order (docs/architecture.md):\n" + "\n".join(found)


def test_lazy_imports_are_named(imports: list[Import]) -> None:
    found = unnamed_lazy(imports)
    assert not found, (
        "function-level imports outside autopart/cli/: import at module level, move the code "
        "to the layer it belongs to, or name the import in LAZY with its reason:\n"
        + "\n".join(found)
    )


def test_the_lists_are_not_stale(imports: list[Import], modules: dict[str, Module]) -> None:
    lazy = {(i.path, i.target) for i in imports if i.where == "function"}
    typed = {(i.path, i.target) for i in imports if i.where == "type"}
    held = {(m.path, name) for m in modules.values() for name, _ in module_containers(m)}
    stale = [f"LAZY {k}" for k in LAZY if k not in lazy]
    stale += [f"TYPE_ONLY {k}" for k in TYPE_ONLY if k not in typed]
    stale += [f"REGISTRIES {k}" for k in REGISTRIES if k not in held]
    stale += [f"PROCESS_STATE {k}" for k in PROCESS_STATE if k not in held]
    assert not stale, "entries that match nothing any more (remove them):\n" + "\n".join(stale)


def test_module_state_is_registries_only(modules: dict[str, Module]) -> None:
    found = [
        f"{m.path}:{line} {name}"
        for m in modules.values()
        for name, line in module_containers(m)
        if (m.path, name) not in REGISTRIES and (m.path, name) not in PROCESS_STATE
    ]
    assert not found, (
        "module-level mutable containers: make a constant a tuple or frozenset, keep state in "
        "an object, or name a registry built at import in REGISTRIES:\n" + "\n".join(found)
    )


def test_registries_are_not_written_after_import(modules: dict[str, Module]) -> None:
    names = {name.rpartition(".")[2] for _, name in REGISTRIES}
    found = [
        f"{m.path}:{line} writes {name}"
        for m in modules.values()
        for name, line in writes_of(m, names)
    ]
    assert not found, "registries are built at import, not written afterwards:\n" + "\n".join(found)


def test_the_checks_see_what_they_forbid() -> None:
    """Negative controls: back-edges (at module level, inside a function, for types only), an
    unnamed lazy import, module and class state and writes into registries, in a made-up
    module, are found."""
    src = (
        "from typing import TYPE_CHECKING\n"
        "from autopart.runtime.runner import Runner\n"
        "from autopart import collectives\n"
        "if TYPE_CHECKING:\n"
        "    from autopart.program.format import Program\n"
        "TABLE = {}\n"
        "class C:\n"
        "    SEEN = set()\n"
        "def f():\n"
        "    from autopart.api import parallelize\n"
        "    TRAITS['x'] = 1\n"
        "    GENERATORS.update({})\n"
        "    out[TRAITS['y']] = SHAPES['z'][0] = 2\n"
    )
    fake = Module("autopart.layout", "autopart/layout.py", src, ast.parse(src))
    known = {"autopart.runtime.runner", "autopart.collectives", "autopart.api"}
    found = imports_of(fake, known | {"autopart.program.format"})
    assert [(i.line, i.target, i.where) for i in found] == [
        (2, "autopart.runtime.runner", "module"),
        (3, "autopart.collectives", "module"),
        (5, "autopart.program.format", "type"),
        (10, "autopart.api", "function"),
    ]
    edges = back_edges(found, {"autopart.layout": fake})
    assert [e.split(" ")[0] for e in edges] == [f"autopart/layout.py:{n}" for n in (2, 3, 5, 10)]
    assert edges[0] == "autopart/layout.py:2 (layout) imports autopart.runtime.runner (runtime)"
    assert unnamed_lazy(found) == ["autopart/layout.py:10 imports autopart.api inside a function"]
    assert module_containers(fake) == [("TABLE", 6), ("C.SEEN", 8)]
    names = {"TRAITS", "GENERATORS", "SHAPES"}
    assert writes_of(fake, names) == [("TRAITS", 11), ("GENERATORS", 12), ("SHAPES", 13)]
