"""Which Mooncake build is installed, told from its files without importing it or touching a GPU.

Mooncake's CUDA build (`mooncake-transfer-engine`) links libcudart and copies GPU memory with cudaMemcpy; the
non-CUDA build (`mooncake-transfer-engine-non-cuda`, scripts/setup.sh's default) knows no GPU, and a device pointer
reaching its put is read with memcpy: the process dies on the first GPU save. The GPU path therefore starts only
over the CUDA build (movers/runtime.py), and says so when it finds the other one.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import struct
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CUDA_INSTALL", "MooncakeBuild", "installed_build", "needed_libraries"]

CUDA_INSTALL = "FLAVOUR=cuda scripts/setup.sh, or pip install mooncake-transfer-engine in place of the non-CUDA build"
_DT_NEEDED, _DT_STRTAB, _PT_LOAD, _PT_DYNAMIC = 1, 5, 1, 2


@dataclass(frozen=True)
class MooncakeBuild:
    """The installed build: its distribution (name and version), whether it reads GPU memory, and what told."""

    distribution: str
    cuda: bool
    detail: str

    def describe(self) -> str:
        """One phrase for logs and refusals."""
        return f"{self.distribution or 'Mooncake'} ({'CUDA' if self.cuda else 'non-CUDA'} build: {self.detail})"


def installed_build(package: str = "mooncake") -> MooncakeBuild:
    """The Mooncake build importable here: CUDA when its store library links libcudart."""
    spec = importlib.util.find_spec(package)
    where = Path(next(iter(spec.submodule_search_locations or ()), "")) if spec is not None else None
    library = where / "store.so" if where is not None else None
    if library is None or not library.is_file():
        return MooncakeBuild(_distribution(), False, f"no {package}/store.so found")
    try:
        needed = needed_libraries(library)
    except (OSError, ValueError) as exc:
        return MooncakeBuild(_distribution(), False, f"{library} unreadable: {exc}")
    cudart = [n for n in needed if n.startswith("libcudart")]
    detail = f"{library.name} links {cudart[0]}" if cudart else f"{library.name} links no libcudart"
    return MooncakeBuild(_distribution(), bool(cudart), detail)


def _distribution() -> str:
    found = sorted(
        f"{d.metadata['Name']} {d.version}"
        for d in importlib.metadata.distributions()
        if (d.metadata["Name"] or "").lower().startswith("mooncake-transfer-engine")
    )
    return ", ".join(found)


def needed_libraries(path: Path) -> list[str]:
    """The DT_NEEDED entries of an ELF64 little-endian shared object (what `readelf -d` lists as NEEDED)."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    phoff, phentsize, phnum = struct.unpack_from("<Q", data, 0x20)[0], *struct.unpack_from("<HH", data, 0x36)
    loads: list[tuple[int, int, int]] = []  # (virtual address, file offset, size in the file)
    dynamic = None
    for i in range(phnum):
        kind, _, offset, vaddr, _, filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        if kind == _PT_LOAD:
            loads.append((vaddr, offset, filesz))
        elif kind == _PT_DYNAMIC:
            dynamic = (offset, filesz)
    if dynamic is None:
        return []
    entries = [struct.unpack_from("<qQ", data, dynamic[0] + at) for at in range(0, dynamic[1], 16)]
    strtab = next((value for tag, value in entries if tag == _DT_STRTAB), None)
    if strtab is None:
        raise ValueError("a dynamic section without a string table")
    # DT_STRTAB is a virtual address: find it in the file through the segment that maps it.
    base = next((offset + strtab - vaddr for vaddr, offset, size in loads if vaddr <= strtab < vaddr + size), None)
    if base is None:
        raise ValueError("the string table lies in no loaded segment")
    names = []
    for tag, value in entries:
        if tag == _DT_NEEDED:
            end = data.index(b"\0", base + value)
            names.append(data[base + value : end].decode())
    return names
