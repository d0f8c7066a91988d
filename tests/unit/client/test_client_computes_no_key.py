"""The client never computes a store key: the daemon owns placement, and a key built in the client is one that can
drift from the daemon's (or forge another tenant's). Enforced over the installed client's source and its imports."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import kvsidecar_client

# The contract's names that make or hold keys: its key functions, and the plans and geometry that build key strings.
KEY_NAMES = frozenset(
    {
        "block_key",
        "namespace_prefix",
        "key_prefix",
        "hash_suffixes",
        "KEY_TAIL_PATTERN",
        "Geometry",
        "GroupGeometry",
        "Chunk",
        "SavePlan",
        "LookupPlan",
        "save_plan",
        "load_plan",
        "lookup_plan",
        "StagedLookup",
    }
)
KEY_MODULES = ("kvsidecar_contract.placement.keys", "kvsidecar_contract.placement.geometry")
# Fragments of the key format `kvs1@<prefix>@<model>~<value id>@s<s>.c<c>.d<d>.p<p>.g<g>@<hex>` and of the
# earlier (and vLLM in-tree) format `[<prefix>@]<model>@tp_rank:<s>@pcp<c>@dcp<d>@pp_rank:<p>@group:<g>@<hex>`.
KEY_FRAGMENTS = ("kvs1@", "tp_rank:", "@pcp", "@dcp", "pp_rank:", "@group:")

CLIENT = Path(kvsidecar_client.__file__).parent


def offences(path: Path) -> list[str]:
    """Every place in one source file that imports, names or formats a key."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(CLIENT.parent)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module in KEY_MODULES:
                found.append(f"{where}: imports {module}")
            found += [f"{where}: imports {a.name}" for a in node.names if a.name in KEY_NAMES]
        elif isinstance(node, ast.Import):
            found += [f"{where}: imports {a.name}" for a in node.names if a.name in KEY_MODULES]
        elif isinstance(node, ast.Name) and node.id in KEY_NAMES:
            found.append(f"{where}: uses {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in KEY_NAMES:
            found.append(f"{where}: uses .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [f"{where}: formats {f!r}" for f in KEY_FRAGMENTS if f in node.value]
    return found


def test_no_client_module_imports_names_or_formats_a_key():
    files = sorted(CLIENT.rglob("*.py"))
    assert CLIENT / "vllm" / "plan.py" in files  # the scan reads the installed client, connector included
    assert [o for f in files for o in offences(f)] == []


def test_the_scan_sees_each_way_of_computing_a_key(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "CLIENT", tmp_path)
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from kvsidecar_contract.placement import key_prefix\n"
        "import kvsidecar_contract.placement.keys\n"
        "from kvsidecar_contract import placement\n"
        "placement.block_key('p', b'')\n"
        "k = f'{m}@tp_rank:{r}@pcp0'\n"
        "k = f'kvs1@{p}@{m}'\n"
    )
    assert len(offences(bad)) == 6


def test_no_imported_client_module_holds_a_key_function():
    # What the installed client binds at run time, aliases included: import every module that imports here
    # (the connector's vLLM side only where vLLM is installed) and look for the contract's key makers among them.
    code = f"""
import importlib, json, pkgutil, sys
import kvsidecar_client
from kvsidecar_contract import placement
from kvsidecar_contract.placement import chunks, geometry, keys, lookup
makers = {{id(getattr(m, n)): n for m in (placement, chunks, geometry, keys, lookup) for n in {sorted(KEY_NAMES)!r}
          if hasattr(m, n)}}
found, imported = [], []
for info in pkgutil.walk_packages(kvsidecar_client.__path__, "kvsidecar_client."):
    try:
        module = importlib.import_module(info.name)
    except ImportError as error:
        if error.name and error.name.split(".")[0] in ("vllm", "sglang", "torch"):
            continue
        raise
    imported.append(info.name)
    found += [f"{{info.name}}.{{a}} is {{makers[id(v)]}}" for a, v in vars(module).items() if id(v) in makers]
print(json.dumps([found, imported]))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120)
    found, imported = json.loads(out.stdout)
    assert "kvsidecar_client.vllm.plan" in imported and "kvsidecar_client.layout" in imported
    assert found == []
