"""The package's structure: imports run one way, and each room keeps to its job.

The import graph is read from the source (``ast``), function-level imports included, over
``streamload/`` (the converters are ``streamload/converters/``: every path is its import name).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers.imports import import_graph, imported_module, package_modules

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"streamload": ROOT / "streamload"}
CONVERTERS = ROOT / "streamload" / "converters"

#: Layers, lowest first: a module may import only from its own layer or lower ones.
#: Within a layer, the graph must still be acyclic (checked separately).
LAYERS: list[tuple[str, ...]] = [
    (
        "streamload._errors",
        "streamload._redact",
        "streamload._classes",
        "streamload._gil",
        "streamload._units",
        "streamload._files",
        "streamload._batchmem",
        "streamload._validate",
        "streamload.timing",
        "streamload._cstderr",
        "streamload._shared",
        "streamload._atexit",
        "streamload._env",
        "streamload._fork",
        "streamload._fields",
        "streamload._jpeghead",
        "streamload._resample",
        "streamload._pread",
        "streamload.node",
    ),
    (
        "streamload.sample",
        "streamload.labels",
        "streamload._hf",
        "streamload.randomness",
        "streamload.manifest",
        "streamload.epochs",
        "streamload.storage",
        "streamload.storage.cache",
        "streamload.storage.ranges",
        "streamload.plan",
    ),
    ("streamload.formats",),
    (
        "streamload.recovery",
        "streamload.storageconfig",
        "streamload.shards",
        "streamload.batch",
        "streamload.writer",
        "streamload.skips",
    ),
    (
        "streamload.decode",
        "streamload.dataref",
        "streamload.streams",
        "streamload.ahead",
        "streamload.plan_stage",
        "streamload.stages",
        "streamload.iterations",
        "streamload.dataset",
        "streamload.verify",
        "streamload.indexing",
        "streamload.shardlist",
        "streamload.access",
    ),
    (
        "streamload.converters",
        "streamload.device",
        "streamload.synthetic",
        "streamload.watch_report",
        "streamload.watching",
        "streamload.loader",
        "streamload.loader_state",
        "streamload._gpudecode",
        "streamload.devicedecode",
    ),
    ("streamload.lightning", "streamload.bench", "streamload.demo"),
    ("streamload.cli", "streamload.__main__", "streamload"),
]


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Return one cycle per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def _layer_of(module: str) -> int:
    best = -1
    best_len = -1
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    return best


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_every_module_has_a_layer() -> None:
    missing = sorted(m for m in import_graph() if _layer_of(m) < 0)
    assert not missing, f"modules not placed in LAYERS: {missing}"


def test_nothing_imports_upward() -> None:
    upward = [
        f"{m} imports {t}"
        for m, targets in sorted(import_graph().items())
        for t in sorted(targets)
        if _layer_of(t) > _layer_of(m)
    ]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("module", ["streamload.storage", "streamload._files"])
def test_storage_knows_no_manifest(module: str) -> None:
    graph = import_graph()
    reached = {t for m, targets in graph.items() if m == module or m.startswith(module + ".") for t in targets}
    assert "streamload.manifest" not in reached, f"{module} imports the manifest"


#: Private names still imported from another module, each with the reason.
PRIVATE_IMPORTS_ALLOWED: set[tuple[str, str]] = set()


def private_imports() -> set[tuple[str, str]]:
    """Return ``(module, imported name)`` for every ``_name`` a module imports from another module."""
    mods = package_modules()
    out: set[tuple[str, str]] = set()
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            module = imported_module(name, path, node)
            if module not in mods or module == name:
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and f"{module}.{alias.name}" not in mods:  # a private module is not a private name
                    out.add((name, f"{module}.{alias.name}"))
    return out


def test_no_private_name_is_imported_acrosspackage_modules() -> None:
    found = private_imports() - PRIVATE_IMPORTS_ALLOWED
    listed = "; ".join(f"{m} imports {n}" for m, n in sorted(found))
    assert not found, f"make these public where they are shared: {listed}"
    assert private_imports() >= PRIVATE_IMPORTS_ALLOWED, "an allowed private import is gone: drop it from the list"


def test_paths_are_import_names() -> None:
    """No package is installed from a directory of another name, and every installed package exists."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "package-dir" not in setuptools, "a package-dir mapping makes a path differ from its import name"
    for package in setuptools["packages"]:
        assert (ROOT.joinpath(*package.split(".")) / "__init__.py").is_file(), f"{package}: no such directory"
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "streamload").rglob("__init__.py")}
    assert on_disk == set(setuptools["packages"]), "pyproject's packages and the directories differ"


#: Lines a module of ``streamload/converters/`` may have at most: a module over it holds more than one job.
CONVERTER_MODULE_LINES = 550


def test_no_converter_module_is_over_the_line_limit() -> None:
    sizes = {path: len(path.read_text().splitlines()) for path in CONVERTERS.rglob("*.py")}
    over = sorted(f"{p.relative_to(ROOT)}: {n} lines" for p, n in sizes.items() if n > CONVERTER_MODULE_LINES)
    assert len(sizes) > 10, "streamload/converters/ was not found"
    assert not over, f"split these by job (at most {CONVERTER_MODULE_LINES} lines): {over}"


#: Lines a module of the package may have at most, and a class: over it, a room holds more than one job.
MODULE_LINES, CLASS_LINES = 600, 300


def _over_the_limits(sources: dict[str, str]) -> list[str]:
    """Modules over :data:`MODULE_LINES` and classes over :data:`CLASS_LINES` among ``sources``."""
    over = []
    for name, text in sorted(sources.items()):
        lines = len(text.splitlines())
        if lines > MODULE_LINES:
            over.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                size = node.end_lineno - node.lineno + 1
                if size > CLASS_LINES:
                    over.append(f"{name}:{node.lineno} class {node.name}: {size} lines")
    return over


def test_no_module_or_class_of_the_package_is_over_the_limits() -> None:
    sources = {str(path.relative_to(ROOT)): path.read_text() for path in (ROOT / "streamload").rglob("*.py")}
    assert len(sources) > 100, "streamload/ was not found"
    over = _over_the_limits(sources)
    assert not over, f"split these by job (modules <= {MODULE_LINES} lines, classes <= {CLASS_LINES}): {over}"


def test_the_limits_check_finds_a_long_module_and_a_long_class() -> None:
    long_class = "class Big:\n" + "    x = 1\n" * CLASS_LINES
    long_module = "y = 1\n" * (MODULE_LINES + 1)
    assert _over_the_limits({"a.py": long_class, "b.py": long_module, "c.py": "class Small:\n    x = 1\n"}) == [
        f"a.py:1 class Big: {CLASS_LINES + 1} lines",
        f"b.py: {MODULE_LINES + 1} lines",
    ]


def _source_class_names(tree: ast.AST) -> list[str]:
    """Names ending in ``Source`` that the second argument of an ``isinstance`` call names."""
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            if len(node.args) < 2:
                continue
            second = node.args[1]
            for part in second.elts if isinstance(second, ast.Tuple) else [second]:
                name = part.attr if isinstance(part, ast.Attribute) else part.id if isinstance(part, ast.Name) else ""
                if name.endswith("Source"):
                    found.append(name)
    return found


def test_the_check_on_source_classes_finds_one() -> None:
    tree = ast.parse("if isinstance(s, (int, TableSource)) or isinstance(s, m.DatasetSource): pass")
    assert _source_class_names(tree) == ["TableSource", "DatasetSource"]
    assert _source_class_names(ast.parse("isinstance(dest, LocalDestination)")) == []


def test_the_engine_asks_no_source_what_it_is() -> None:
    """Sources tell the engine what it needs through the ``Source`` hooks, never by their class."""
    tree = ast.parse((CONVERTERS / "engine.py").read_text())
    assert not _source_class_names(tree), "engine.py: isinstance on a source class; add a Source hook instead"
    named = sorted(
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.name.endswith("Source") and alias.name != "Source"
    )
    assert not named, f"engine.py imports concrete sources: {named}"


#: The modules that drive the dataset from outside (the thread loader, its state conversion, watch):
#: they use the dataset's public seams only.
SEAM_USERS = ("streamload/loader.py", "streamload/loader_state.py", "streamload/watching.py")


def private_reaches(text: str) -> list[str]:
    """``obj._name`` attribute uses in ``text`` on anything but ``self``/``cls`` (dunders aside), with their lines."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_private_reach_check_finds_one() -> None:
    assert private_reaches("self._a = ds._planner.resume\nx.__class__\ncls._b") == ["1: ds._planner"]


@pytest.mark.parametrize("path", SEAM_USERS)
def test_the_loader_and_watch_reach_into_no_private_attribute(path: str) -> None:
    reaches = private_reaches((ROOT / path).read_text())
    assert not reaches, f"{path} reaches into private attributes (use a public seam): {reaches}"


def test_watch_changes_no_class() -> None:
    """``watch(attach=True)`` hands out a twin; nothing assigns an object's ``__class__``."""
    for path in SEAM_USERS:
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if isinstance(node, ast.Assign):
                targets = [t for t in node.targets if isinstance(t, ast.Attribute) and t.attr == "__class__"]
                assert not targets, f"{path}:{node.lineno} assigns __class__"


#: Public class names still defined twice, each with where (a name says one thing: remove, never add).
SHARED_CLASS_NAMES_ALLOWED: dict[str, set[str]] = {}


def public_class_names(sources: dict[str, str]) -> dict[str, set[str]]:
    """Public class name -> the modules (of ``sources``) that define a class of that name."""
    out: dict[str, set[str]] = {}
    for name, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                out.setdefault(node.name, set()).add(name)
    return out


def test_the_name_check_finds_a_name_defined_twice() -> None:
    two = {"a.py": "class A: pass\nclass _P: pass", "b.py": "class A(Protocol): pass\nclass _P: pass"}
    names = public_class_names(two)
    assert names == {"A": {"a.py", "b.py"}}


def test_no_two_classes_of_the_package_share_a_name() -> None:
    sources = {str(path.relative_to(ROOT)): path.read_text() for path in (ROOT / "streamload").rglob("*.py")}
    shared = {n: where for n, where in public_class_names(sources).items() if len(where) > 1}
    assert shared == SHARED_CLASS_NAMES_ALLOWED, f"one name, one thing: rename one of each: {shared}"


#: The modules that read the environment (``streamload._env``): the storage's settings, resolved once in
#: ``StorageConfig``; a conversion's (its progress bar, ``RAY_ADDRESS``); the endpoint botocore reads (a cache key).
ENVIRONMENT_READERS = {"streamload.storageconfig", "streamload.converters.engine", "streamload.storage.backends.s3"}


def test_the_environment_is_read_by_three_modules_at_most() -> None:
    """Defaults are applied where the settings are made and passed down resolved, not at the bottom."""
    readers = {m for m, targets in import_graph().items() if "streamload._env" in targets}
    assert len(readers) <= 3, f"{len(readers)} modules import streamload._env: {sorted(readers)}"
    assert readers == ENVIRONMENT_READERS, sorted(readers)


def mixin_fields(text: str) -> list[str]:
    """Private attributes a class declares without a value and never assigns: another class's state it reads."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.ClassDef) or any(
            isinstance(d, ast.Name) and d.id == "dataclass" or isinstance(d, ast.Call) for d in node.decorator_list
        ):
            continue
        declared = [
            s.target.id
            for s in node.body
            if isinstance(s, ast.AnnAssign) and s.value is None and isinstance(s.target, ast.Name)
        ]
        assigned = {
            t.attr
            for n in ast.walk(node)
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else [])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
        }
        found += [f"{node.name}.{name}" for name in declared if name.startswith("_") and name not in assigned]
    return found


def test_the_mixin_check_finds_one() -> None:
    mixin = "class Part:\n    _proc: Any\n    def f(self):\n        return self._proc.x\n"
    owner = "class Owner:\n    _proc: Any\n    def __init__(self):\n        self._proc = 1\n"
    assert mixin_fields(mixin) == ["Part._proc"] and mixin_fields(owner) == []


def test_remote_storage_is_composed_of_parts_not_mixins() -> None:
    """``RemoteStorage``'s parts get what they need in their constructors; none reads its private state."""
    from streamload.storage.base import Storage
    from streamload.storage.remote import RemoteStorage

    assert RemoteStorage.__bases__ == (Storage,)
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "streamload" / "storage").rglob("*.py")}
    found = [f"{name}: {field}" for name, text in sorted(sources.items()) for field in mixin_fields(text)]
    assert not found, f"classes that read another object's private state (pass it to their constructor): {found}"


#: The read path's rooms below its nodes (the fetch and read nodes call them; they call nothing above).
BELOW_THE_NODES = ("streamload.storage", "streamload.shards", "streamload.formats")


def _below_the_nodes(module: str) -> bool:
    return any(module == room or module.startswith(room + ".") for room in BELOW_THE_NODES)


def test_nothing_below_the_read_nodes_knows_of_a_clock() -> None:
    """The watch's clocks are entered by the nodes around their calls, never from ``storage/`` or ``shards.py``."""
    mods = package_modules()
    clocks = [
        name
        for name, path in mods.items()
        if any(isinstance(n, ast.ClassDef) and n.name == "Clock" for n in ast.walk(ast.parse(path.read_text())))
    ]
    graph = import_graph()
    knowing = sorted(m for m, targets in graph.items() if _below_the_nodes(m) and targets & set(clocks))
    assert not knowing, f"these rooms below the read path's nodes import the watch's clocks: {knowing}"
    assert clocks == ["streamload.timing"], f"the clocks' module is named for them: {clocks}"


def _calls_of(path: Path, names: set[str]) -> list[str]:
    """``x.name(...)`` calls in ``path`` of a method in ``names``, as ``name@line``."""
    return [
        f"{node.func.attr}@{node.lineno}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names
    ]


def test_the_fetch_node_owns_the_cold_start() -> None:
    """Opening a cold batch's shards, asking for its bytes and ending the cold start: the fetch node's calls only.

    ``ShardSource`` is the readers' cache and ``MixedSource`` addresses its streams: neither
    relays ``open_cold``, ``want`` or ``started``, nor names or cancels read-ahead; the read
    node (``stages.Read``) only reads, and the pipeline's top tells the fetch node (not the
    readers) that its first item is out.
    """
    cold = {"open_cold", "want", "started"}
    for module, classes in (("shards", {"ShardSource"}), ("streams", {"MixedSource"})):
        tree = ast.parse((ROOT / "streamload" / f"{module}.py").read_text())
        relays = [
            f"{c.name}.{f.name}"
            for c in ast.walk(tree)
            if isinstance(c, ast.ClassDef) and c.name in classes
            for f in c.body
            if isinstance(f, ast.FunctionDef) and f.name in cold
        ]
        assert not relays, f"the readers relay the cold start: {relays}"
    callers = {
        str(path.relative_to(ROOT)): calls
        for name, path in package_modules().items()
        if not name.startswith("streamload.storage")  # the storage's own internals (its download's want)
        and (calls := _calls_of(path, cold))
    }
    assert set(callers) == {"streamload/ahead.py", "streamload/stages.py"}, callers
    assert [c.split("@")[0] for c in callers["streamload/stages.py"]] == ["started"], callers  # ahead.started()
    stages = ast.parse((ROOT / "streamload" / "stages.py").read_text())
    read = next(c for c in ast.walk(stages) if isinstance(c, ast.ClassDef) and c.name == "Read")
    fetching = [
        f"{n.func.attr}@{n.lineno}"
        for n in ast.walk(read)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in cold | {"prepare"}
    ]
    assert not fetching, f"the read node does fetch work: {fetching}"
    for module in ("shards", "streams"):  # the read-ahead it names is the fetch node's to cancel too
        calls = _calls_of(ROOT / "streamload" / f"{module}.py", {"fetch_ahead", "ahead_depth"})
        assert not calls, f"{module}.py drives the storage's read-ahead: {calls}"
