"""The package's layers, as docs/architecture.md documents them: every import in tiercache goes where the table allows,
every module belongs to a documented layer and says what it is, and an engine process importing the client loads no
server-side code. And the "one of each" claims the code makes: errors.WIRE_CODES is the only table of error codes,
client.settings the only reader of tiercache's environment variables, prefix.objects the only module that takes an
object key apart; no two modules import each other, however indirectly, and none is over 350 lines. And the rooms
of the repository (ROOMS: the product, testkit, tests and the lab) import one another only as that table allows."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import python_env

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tiercache"
DOC = ROOT / "docs" / "architecture.md"
SERVER_SIDE = ("tiercache.store", "tiercache.tiers", "tiercache.server", "tiercache.events")
SERVER_LIBRARIES = ("yaml", "redis", "prometheus_client", "zmq", "msgpack")


def documented_layers() -> dict[str, set[str]]:
    """The table between the layers markers: layer -> the layers it may import."""
    text = DOC.read_text()
    table = text[text.index("<!-- layers:begin -->"):text.index("<!-- layers:end -->")]
    layers = {}
    for row in table.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            layers[cells[0].strip("`")] = set(re.findall(r"`([\w.]+)`", cells[1]))
    return layers


def modules() -> list[tuple[str, Path]]:
    """(dotted name, path) of every module in the package but the generated stubs."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if "_proto" in parts:
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found.append((name, path))
    return found


def layer_of(module: str) -> str | None:
    """The layer a dotted module name is in: the first name under tiercache (None for the package root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def imported_layers(path: Path) -> set[tuple[str, int]]:
    """(layer, line) of every tiercache import in a module, function-level ones too (a lazy import is still one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "tiercache":  # `from tiercache import x`: a submodule, or a name of the root package
                names = [f"tiercache.{alias.name}" for alias in node.names
                         if (PACKAGE / alias.name).is_dir() or (PACKAGE / f"{alias.name}.py").exists()]
            else:
                names = [node.module]
        for name in names:
            layer = layer_of(name) if name.startswith("tiercache.") else None
            if layer:
                found.add((layer, node.lineno))
    return found


def test_the_doc_names_a_layer_for_every_module():
    layers = documented_layers()
    assert "errors" in layers and "client" in layers  # the table was found
    missing = sorted({layer_of(name) for name, _ in modules()} - set(layers) - {None})
    assert missing == [], f"add these to the layers table in docs/architecture.md: {missing}"


def test_every_import_follows_the_documented_direction():
    layers = documented_layers()
    broken = []
    for name, path in modules():
        own = layer_of(name)
        if own is None:
            continue  # the package root imports nothing eagerly (checked below)
        for layer, line in sorted(imported_layers(path)):
            if layer != own and layer not in layers[own]:
                broken.append(f"{path.relative_to(ROOT)}:{line} imports {layer} ({own} may import "
                              f"{', '.join(sorted(layers[own])) or 'nothing'})")
    assert broken == []


def test_every_module_says_what_it_is():
    undocumented = [str(path.relative_to(ROOT)) for _, path in modules()
                    if not ast.get_docstring(ast.parse(path.read_text()))]
    assert undocumented == []


@pytest.mark.parametrize("entry", ["tiercache", "tiercache.client", "tiercache.connector"])
def test_an_engine_process_loads_no_server_side_code(entry):
    script = (f"import sys, {entry}\n"
              f"print('\\n'.join(sorted(m for m in sys.modules if m.startswith({SERVER_SIDE!r}) "
              f"or m.split('.')[0] in {SERVER_LIBRARIES!r} or m == 'tiercache.server.auth')))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT,
                         env=python_env())
    assert out.stdout.split() == []


def test_errors_wire_codes_is_the_only_table_of_error_codes():
    """No module but errors.py writes a code of WIRE_CODES: a gRPC status of the table as `StatusCode.X` or as a
    string, or a `WireCode`. The one exception, protocol.wire.error_of, reads two statuses grpc raises itself (a
    connection that failed, a deadline that passed) before it looks the rest up in the table."""
    from tiercache.errors import WIRE_CODES

    statuses = {row.grpc_status for row in WIRE_CODES}
    allowed = {("protocol/wire.py", "UNAVAILABLE"), ("protocol/wire.py", "DEADLINE_EXCEEDED")}
    found = []
    for _, path in modules():
        relative = str(path.relative_to(PACKAGE))
        if relative == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "StatusCode" and node.attr in statuses:
                name = node.attr
            elif isinstance(node, ast.Constant) and node.value in statuses:
                name = node.value
            elif isinstance(node, ast.Name) and node.id == "WireCode":
                name = "WireCode"
            if name and (relative, name) not in allowed:
                found.append(f"{relative}:{node.lineno} {name}")
    assert found == []


def test_client_settings_is_the_only_reader_of_tiercache_environment_variables():
    readers = sorted(str(path.relative_to(PACKAGE)) for _, path in modules()
                     if re.search(r"""["']TIERCACHE_""", path.read_text()))
    assert readers == ["client/settings.py"]


def imported_modules(path: Path) -> set[str]:
    """The tiercache modules a module imports, lazy and type-checking ones too (`from a.b import c` names a.b.c when c
    is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if _is_module(submodule) else node.module)
    return {name for name in found if name.startswith("tiercache.") and _is_module(name)}


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def test_no_import_circle():
    """A circle between two modules means neither can be read (or changed) alone; the layers table allows circles
    inside a layer, this does not."""
    graph = {name: imported_modules(path) - {name} for name, path in modules()}
    circles = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            circle = trail[trail.index(name):]
            start = circle.index(min(circle))
            circles.add(" -> ".join(circle[start:] + circle[:start] + [min(circle)]))
            return
        if name in done:
            return
        for imported in sorted(graph.get(name, ())):
            visit(imported, trail + [name])
        done.add(name)

    done: set[str] = set()
    for name in sorted(graph):
        visit(name, [])
    assert sorted(circles) == []


KEY_SLICES = {"[:16]", "[:HASH_BYTES]", "[16]", "[17]", "[HASH_BYTES]", "[-2]", "[-1]", "[-2:]", "[-2:-1]", "[16:]"}


def test_only_prefix_objects_takes_an_object_key_apart():
    """Object keys are a chain hash, a kind and a group (prefix.objects.ObjectKey): a module that slices one by hand,
    or builds one from bytes((ObjectKind...)), breaks when the layout of a key changes."""
    owner = PACKAGE / "prefix" / "objects.py"
    by_hand = []
    for _, path in modules():
        if path == owner:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Subscript) and re.search(r"(^|[._])key$", ast.unparse(node.value)) \
                    and f"[{ast.unparse(node.slice)}]" in KEY_SLICES:
                by_hand.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "bytes" and "ObjectKind." in ast.unparse(node):
                by_hand.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert by_hand == []


def test_no_module_is_over_350_lines():
    """A module past ~350 lines holds more than one concept: split it by what it holds (the generated stubs aside)."""
    long = [f"{path.relative_to(ROOT)}: {n} lines" for _, path in modules()
            if (n := len(path.read_text().splitlines())) > 350]
    assert long == []


# -- the rooms: the product, the test kit, the tests and the lab stand apart --------------------------------------
# tiercache (the product) imports none of the others; testkit (what the tests and the lab both need: engine harnesses,
# Redis processes, the trace reader, router indexes) imports the product alone; the tests (tests/) import the product
# and the test kit, never the lab; the lab (lab/, its own tests in lab/tests, and the package's micro-benchmarks in
# benchmarks/) imports no tests. The micro-benchmarks may use the lab (lab.common); the lab imports no micro-benchmark
# but in its tests, which test them too. What two rooms both need goes to testkit/.

ROOMS = {  # room -> the rooms it must not import
    "tiercache": {"testkit", "tests", "lab", "benchmarks"},
    "testkit": {"tests", "lab", "benchmarks"},
    "tests": {"lab", "benchmarks"},
    "lab": {"tests", "benchmarks"},
    "benchmarks": {"tests"},
}
LAB_TESTS = ROOT / "lab" / "tests"


def _top_imports(path: Path) -> set[str]:
    """The top-level names (tests, lab, testkit, ...) a file imports, lazy imports too."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def _files(room: str) -> list[Path]:
    return sorted(p for p in (ROOT / room).rglob("*.py") if "_proto" not in p.parts)


def _not_imported(room: str, path: Path) -> set[str]:
    return ROOMS[room] - {"benchmarks"} if LAB_TESTS in path.parents else ROOMS[room]


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_each_room_imports_no_room_it_must_not(room):
    wrong = [f"{p.relative_to(ROOT)} imports {sorted(names)}" for p in _files(room)
             for names in [_top_imports(p) & _not_imported(room, p)] if names]
    assert not wrong, f"{room} may not import {sorted(ROOMS[room])} (move what both need to testkit/): {wrong}"


@pytest.mark.parametrize("room", ["lab", "benchmarks"])
def test_the_lab_runs_as_modules_and_changes_no_import_path(room):
    """Every lab entry and micro-benchmark runs as `python -m <room>.<name>` from the checkout's root, which puts the
    checkout first on sys.path, in every venv: a module that edits sys.path decides for itself which code it imports."""
    editing = [f"{p.relative_to(ROOT)}:{node.lineno}" for p in _files(room)
               for node in ast.walk(ast.parse(p.read_text()))
               if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "sys.path"
               and node.attr in ("insert", "append", "extend")]
    assert editing == []
