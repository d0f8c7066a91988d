"""The daemon image built without Docker: a Debian base made by debootstrap, the Dockerfile built by buildah.

buildah builds the repository's Dockerfile as root with chroot isolation. The base image, which cannot be pulled
here, is Debian bookworm from Debian's archive (debootstrap, with the Python the Dockerfile's stages run) committed
with `buildah from scratch`; it stays in buildah's storage between runs on one machine, under a name that changes
with what goes into it (a CI machine starts without it). pip inside the build reaches what the machine's pip
reaches: the machine's pip configuration becomes /etc/pip.conf of every RUN step, and every local folder or file it
names (wheel folders, local indexes, constraints, the CA bundle) is mounted read-only at its own path.

By hand: `python tests/image/image_build.py --flavour cuda --tag kvsidecar:0.1.0-cuda` (where its wheels are
reachable).
"""

from __future__ import annotations

import argparse
import configparser
import contextlib
import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
# What the Dockerfile's stages run besides Debian's minimal base: python (and venv), and CA certificates for pip.
PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates")
# The sources of Debian's own bookworm image, so the runtime stage's apt-get sees security updates too.
SOURCES = f"""Types: deb
URIs: {MIRROR}
Suites: {SUITE} {SUITE}-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: {SUITE}-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""
BASE_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8")
BASE_LOCK = Path(tempfile.gettempdir()) / "kvsidecar-image-base.lock"
TOOLS = ("buildah", "debootstrap", "unshare", "nsenter", "ip")


def missing_tools() -> str:
    """Why this machine cannot build and run the image ("" when it can)."""
    if os.geteuid() != 0:
        return "building with buildah's chroot isolation needs root"
    absent = [tool for tool in TOOLS if shutil.which(tool) is None]
    if absent:
        return f"{', '.join(absent)} not installed (Debian: apt-get install buildah debootstrap util-linux iproute2)"
    return ""


# ---- the machine's pip configuration --------------------------------------------------------------------------------

_CONFIG_LINE = re.compile(r"^(?P<section>[^.]+|:env:)\.(?P<key>[\w-]+)='(?P<value>.*)'$")


def pip_configuration(listing: str) -> dict[str, dict[str, str]]:
    """`pip config list` as sections of settings; its environment variables go to [global] and win there."""
    sections: dict[str, dict[str, str]] = {}
    from_env: dict[str, str] = {}
    for line in listing.splitlines():
        m = _CONFIG_LINE.match(line.strip())
        if m is None:
            continue
        if m["section"] == ":env:":
            from_env[m["key"]] = m["value"]
        else:
            sections.setdefault(m["section"], {})[m["key"]] = m["value"]
    sections.setdefault("global", {}).update(from_env)
    return sections


def pip_conf(sections: dict[str, dict[str, str]]) -> str:
    """An /etc/pip.conf that says what the machine's configuration says."""
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_dict(sections)
    out = io.StringIO()
    parser.write(out)
    return out.getvalue()


def local_paths(sections: dict[str, dict[str, str]]) -> list[Path]:
    """The existing local files and folders the configuration names (file:// URLs and absolute paths).

    A local index's pages link to its files by relative paths (`simple/x/` to `../../files/...`): the folder that
    holds the index goes in whole.
    """
    found: dict[Path, None] = {}
    for settings in sections.values():
        for key, value in settings.items():
            for word in value.split():
                path = Path(word.removeprefix("file://")) if word.startswith(("/", "file:///")) else None
                if path is not None and key.endswith("index-url"):
                    path = path.parent
                if path is not None and path.exists():
                    found[path] = None
    return list(found)


def machine_pip() -> dict[str, dict[str, str]]:
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return pip_configuration(listing)


# ---- the base image -------------------------------------------------------------------------------------------------


def base_name() -> str:
    """The cached base's name: it changes with anything that changes what debootstrap would make."""
    recipe = json.dumps([SUITE, MIRROR, PACKAGES, SOURCES, BASE_ENV]).encode()
    return f"localhost/kvsidecar-base:{SUITE}-{hashlib.sha256(recipe).hexdigest()[:12]}"


def _buildah(*args: str, timeout: float = 600) -> str:
    done = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"buildah {' '.join(args)}: {done.stderr.strip()[-2000:]}")
    return done.stdout.strip()


def image_exists(name: str) -> bool:
    return subprocess.run(["buildah", "inspect", "--type", "image", name], capture_output=True).returncode == 0


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One maker of the base on this machine at a time; the others then find it made."""
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_base(log: Path, timings: dict[str, float]) -> str:
    """The base image, made by debootstrap and committed from scratch unless this machine already holds it."""
    name = base_name()
    with _locked(BASE_LOCK):
        if image_exists(name):
            timings["base (cached)"] = 0.0
            return name
        with tempfile.TemporaryDirectory(prefix="kvsidecar-rootfs-") as tmp:
            rootfs = Path(tmp) / "rootfs"
            started = time.monotonic()
            with open(log, "a") as out:
                subprocess.run(
                    ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(rootfs), MIRROR],
                    stdout=out, stderr=subprocess.STDOUT, check=True, timeout=1200,
                )  # fmt: skip
            timings["debootstrap"] = time.monotonic() - started
            started = time.monotonic()
            (rootfs / "etc/apt/sources.list").unlink(missing_ok=True)
            (rootfs / "etc/apt/sources.list.d/debian.sources").write_text(SOURCES)
            for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
                for entry in (rootfs / cache).glob("*"):
                    if entry.is_file():
                        entry.unlink()
            _commit_rootfs(rootfs, name)
            timings["base commit"] = time.monotonic() - started
    return name


def _commit_rootfs(rootfs: Path, name: str) -> None:
    container = _buildah("from", "scratch")
    try:
        mount = _buildah("mount", container)
        subprocess.run(["cp", "-a", f"{rootfs}/.", mount], check=True, timeout=600)
        _buildah("umount", container)
        _buildah("config", *(f"--env={env}" for env in BASE_ENV), "--cmd=python3", container)
        _buildah("commit", "--quiet", container, name)
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True)


# ---- the build ------------------------------------------------------------------------------------------------------


@dataclass
class Build:
    """What one build took: the phases, each Dockerfile step, and the log."""

    tag: str
    log: Path
    timings: dict[str, float] = field(default_factory=dict)
    steps: list[tuple[str, float]] = field(default_factory=list)


def build(flavour: str, tag: str, workdir: Path) -> Build:
    """Build the Dockerfile's `flavour` as `tag` on the base, with the machine's pip configuration."""
    result = Build(tag, workdir / "build.log")
    base = ensure_base(result.log, result.timings)
    pip = machine_pip()
    conf = workdir / "pip.conf"
    conf.write_text(pip_conf(pip))
    mounts = [f"{conf}:/etc/pip.conf:ro", *(f"{p}:{p}:ro" for p in local_paths(pip))]
    # The Dockerfile's default torch index is PyTorch's own; this machine's pip finds the CPU torch through its own
    # index and wheel folders, as scripts/setup.sh does.
    index = pip.get("global", {}).get("index-url", "https://pypi.org/simple")
    command = [
        "buildah", "build", "--isolation", "chroot", "--format", "docker", "--pull=never",
        "--build-arg", f"PYTHON_IMAGE={base}", "--build-arg", f"FLAVOUR={flavour}",
        "--build-arg", f"TORCH_INDEX_URL={index}",
        *(arg for mount in mounts for arg in ("--volume", mount)),
        "--tag", tag, "--file", str(ROOT / "Dockerfile"), str(ROOT),
    ]  # fmt: skip
    started = time.monotonic()
    step, step_started = "", started
    with (
        open(result.log, "a") as out,
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc,
    ):
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                out.write(line)
                if re.match(r"\[\d+/\d+\] (STEP|COMMIT)", line):
                    now = time.monotonic()
                    if step:
                        result.steps.append((step, now - step_started))
                    step, step_started = line.strip()[:100], now
        except BaseException:  # a timeout, Ctrl-C: buildah removes its working containers when told to stop
            proc.terminate()
            raise
        code = proc.wait()
    now = time.monotonic()
    if step:
        result.steps.append((step, now - step_started))
    result.timings["build"] = now - started
    if code != 0:
        raise RuntimeError(f"buildah build exited {code}; the end of {result.log}:\n{tail(result.log)}")
    return result


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def inspect(tag: str) -> dict[str, Any]:
    """The image's configuration (Docker format: it keeps the HEALTHCHECK) and its layers' sizes."""
    info = json.loads(_buildah("inspect", "--type", "image", tag))
    manifest = json.loads(info["Manifest"])
    return {"config": info["Docker"]["config"], "layers": [layer["size"] for layer in manifest["layers"]]}


def remove_image(tag: str) -> None:
    subprocess.run(["buildah", "rmi", "--force", tag], capture_output=True, timeout=120)


# ---- what a check leaves, named by its process ---------------------------------------------------------------------

CHECK = "kvsidecar-check"


def check_name() -> str:
    """A name for this process's image or container: the PID says whose it is, should the process be killed."""
    return f"{CHECK}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def prune_stale() -> None:
    """Remove the check images and containers of processes that are gone (killed before they cleaned up)."""
    listed = [
        ("rm", subprocess.run(["buildah", "containers", "--format", "{{.ContainerName}}"], **_TEXT).stdout),
        ("rmi", subprocess.run(["buildah", "images", "--format", "{{.Name}}:{{.Tag}}"], **_TEXT).stdout),
    ]
    for verb, names in listed:
        for name in names.split():
            m = re.fullmatch(rf"(?:localhost/)?{CHECK}[-:](\d+)-[0-9a-f]+(?::latest)?", name)
            if m and not Path(f"/proc/{m[1]}").exists():
                subprocess.run(["buildah", verb, name], capture_output=True, timeout=120)


_TEXT: dict[str, Any] = {"capture_output": True, "text": True, "timeout": 120}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavour", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    why = missing_tools()
    if why:
        print(f"image_build: {why}", file=sys.stderr)
        return 2
    tag = args.tag or f"localhost/kvsidecar:0.1.0-{args.flavour}"
    with tempfile.TemporaryDirectory(prefix="kvsidecar-image-") as tmp:
        try:
            done = build(args.flavour, tag, Path(tmp))
        except (RuntimeError, subprocess.CalledProcessError) as exc:
            print(f"image_build: {exc}", file=sys.stderr)
            return 1
    sizes = inspect(tag)["layers"]
    print(f"built {tag}: {sum(sizes) / 1e9:.2f} GB ({sizes[0] / 1e6:.0f} MB base), " + phases(done.timings))
    return 0


def phases(timings: dict[str, float]) -> str:
    return ", ".join(f"{name} {seconds:.0f} s" for name, seconds in timings.items())


if __name__ == "__main__":
    sys.exit(main())
