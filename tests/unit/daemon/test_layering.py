"""The daemon's rooms import only what their docstrings say, by folder rule: a new module falls under its folder's.

Each room (a folder of kvsidecar/, or a module directly in it) opens with a docstring whose `Imports:` line names
the rooms it may import and, after a `;`, the heavy third-party packages it may import. Imports under
`if TYPE_CHECKING:` are types only and do not count; imports inside functions do.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import kvsidecar
import kvsidecar_client

PACKAGE = Path(kvsidecar.__file__).parent
# Third-party packages whose use must stay in the rooms that declare them.
HEAVY = {"grpc", "mooncake", "torch", "uvloop", "prometheus_client"}
MOST_TOP_MODULES = 10


def rooms() -> dict[str, Path]:
    """Room name -> the file whose docstring declares its imports."""
    out = {}
    for p in sorted(PACKAGE.iterdir()):
        if p.is_dir() and (p / "__init__.py").exists():
            out[p.name] = p / "__init__.py"
        elif p.suffix == ".py" and p.name not in ("__init__.py", "__main__.py"):
            out[p.stem] = p
    return out


def declared(path: Path) -> tuple[set[str], set[str]]:
    """(rooms, heavy packages) the `Imports:` line of a docstring allows."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    match = re.search(r"^Imports:(.*?)(?:\.\s*$|\Z)", doc, re.MULTILINE | re.DOTALL)
    assert match, f"{path.relative_to(PACKAGE)}: the docstring has no `Imports:` line"
    text = re.sub(r"\([^)]*\)", "", match.group(1))
    ours, _, heavy = text.partition(";")

    def names(part: str) -> set[str]:
        return {w.strip() for w in part.replace("\n", " ").split(",") if w.strip()}

    return names(ours), names(heavy)


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                lines.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return lines


def imports(path: Path) -> set[str]:
    """Every module a file imports, wherever in the file, but for type-checking-only imports."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    found = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            if node.module == "kvsidecar":
                found.update(f"kvsidecar.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def room_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE).parts
    return rel[0].removesuffix(".py")


def test_at_most_ten_modules_directly_in_the_package():
    top = [p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert len(top) <= MOST_TOP_MODULES, top


def test_every_room_says_what_it_holds_and_may_import():
    for name, path in rooms().items():
        ours, _ = declared(path)
        unknown = ours - set(rooms())
        assert not unknown, f"{name}: `Imports:` names no such room: {sorted(unknown)}"


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_imports_only_what_its_room_declares(path):
    room = room_of(path)
    if room in ("__init__", "__main__"):
        return
    allowed, heavy = declared(rooms()[room])
    for module in sorted(imports(path)):
        parts = module.split(".")
        where = path.relative_to(PACKAGE)
        if parts[0] == "kvsidecar" and len(parts) > 1 and parts[1] in rooms() and parts[1] != room:
            assert parts[1] in allowed, f"{where} imports {module}: room {room} may import {allowed}"
        family = "grpc" if parts[0].startswith("grpc") else parts[0]  # grpc, grpc_health, grpc_reflection
        if family in HEAVY:
            assert family in heavy, f"{where} imports {parts[0]}: room {room} may use {heavy}"


def test_only_the_serving_rooms_import_grpc():
    # The rule the issue states, read off the declarations: a room that declares grpc is rpc/, daemon/ or cli/; only
    # store/ touches Mooncake.
    grpc_rooms = {name for name, path in rooms().items() if "grpc" in declared(path)[1]}
    assert grpc_rooms == {"rpc", "daemon", "cli"}
    assert {name for name, path in rooms().items() if "mooncake" in declared(path)[1]} == {"store"}


def test_rooms_form_no_cycle_at_module_level():
    graph = {name: declared(path)[0] for name, path in rooms().items()}
    seen: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        if seen.get(node) == 1:
            raise AssertionError("import cycle: " + " -> ".join([*stack, node]))
        if seen.get(node) == 2:
            return
        seen[node] = 1
        for nxt in sorted(graph[node]):
            visit(nxt, [*stack, node])
        seen[node] = 2

    for name in sorted(graph):
        visit(name, [])


# Configuration sits at the top of the house: config/ reads the flags and the file, takes each default and parser
# from the part it configures, and cuts Config into each part's settings (config/cut.py). Only the command line
# (cli/serve.py) imports it: no part below it reads a flag.
CONFIG_IMPORTERS = {"cli"}


def test_configuration_sits_at_the_top():
    importers = {
        room_of(path)
        for path in PACKAGE.rglob("*.py")
        if room_of(path) != "config" and any(m.split(".")[:2] == ["kvsidecar", "config"] for m in imports(path))
    }
    assert importers == CONFIG_IMPORTERS
    below_config = {name for name, path in rooms().items() if "config" in declared(path)[0]}
    assert below_config == CONFIG_IMPORTERS


def test_the_two_ways_in_hand_their_calls_to_the_one_dispatcher():
    # A method's messages, frame number, pool, gate and size limit are its row's (kvsidecar_contract.methods); the
    # gRPC servicer and the data socket each hand a call to the one dispatcher (rpc/dispatch.py), which runs the
    # row's handler (rpc/handlers.py). Neither way in knows the other, and nothing below them knows either.
    rpc = PACKAGE / "rpc"
    grpc_side = {"kvsidecar.rpc.servicer", "kvsidecar.rpc.servers"}
    for name in ("servicer.py", "servers.py"):
        assert "kvsidecar.rpc.datasocket" not in imports(rpc / name), name
    assert not imports(rpc / "datasocket.py") & grpc_side
    for name in ("servicer.py", "datasocket.py"):
        assert "kvsidecar.rpc.dispatch" in imports(rpc / name), name
    ways_in = grpc_side | {"kvsidecar.rpc.datasocket"}
    assert not imports(rpc / "dispatch.py") & ways_in
    assert not imports(rpc / "handlers.py") & (ways_in | {"kvsidecar.rpc.dispatch"})
    for name in ("servicer.py", "datasocket.py", "dispatch.py"):
        assert "kvsidecar_contract.methods" in imports(rpc / name), name
    client = Path(kvsidecar_client.__file__).parent
    assert "kvsidecar_contract.methods" in imports(client / "_data.py")


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_daemon_uses_only_the_clients_public_modules(path):
    private = [m for m in imports(path) if m.startswith("kvsidecar_client.") and "._" in f".{m.split('.', 1)[1]}"]
    assert not private, f"{path.relative_to(PACKAGE)} imports {private}: use the client's public API"
