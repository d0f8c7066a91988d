"""Tenants: who a caller is (its credentials) and what it may do (its rights), parsed from the tenants file.

Pure: parsing a TOML text and matching credentials; reading the file and reloading it live in tenancy.py.

    [tenants.team-a]
    uids = [1001]                      # Unix-socket peers by uid (SO_PEERCRED, via a side-socket ticket)
    gids = [2001]                      # ... or by any of their groups
    tokens = ["sha256:<hex>"]          # bearer tokens on the TCP listener, stored as SHA-256 hashes
    cert_subjects = ["CN=engine-a"]    # mTLS client certificate subjects, as gRPC reports them
    prefixes = ["team-a", "team-a/*"]  # cache prefixes it may open sessions under ('*' only at the end)
    models = ["Llama-3*"]              # optional: the models it may open sessions for (default: any), matched
                                       # against what keys carry: the model name's last path component
    admin = false                      # Stats shows every tenant
    operator = false                   # may pin hard and drop any tenant's retentions (docs/retention.md)
    shm_names = false                  # may register /dev/shm names (trusted ranks only; see docs/security.md)
    write_bytes_per_second = "64MiB"   # optional write budget, with a burst
    write_burst_bytes = "256MiB"
    max_registered_bytes = "256GiB"    # optional: host memory its sessions may register (default: the daemon's
                                       # --max-registered-bytes-per-account)
    retained_bytes = "8GiB"            # optional: what its requests may keep ahead of ordinary cache (default 0:
                                       # nothing; docs/retention.md)
"""

from __future__ import annotations

import hashlib
import hmac
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from kvsidecar.errors import ConfigError, Forbidden
from kvsidecar.parsing import parse_size
from kvsidecar_contract.placement import model_key

__all__ = [
    "SINGLE_TENANT",
    "Caller",
    "Tenant",
    "TenantTable",
    "hash_token",
    "parse_tenants",
]

SINGLE_TENANT = ""  # the tenant name of every session when no tenants file is configured
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_TOKEN_HASH = re.compile(r"sha256:[0-9a-f]{64}")
_KEYS = {
    "uids",
    "gids",
    "tokens",
    "cert_subjects",
    "prefixes",
    "models",
    "admin",
    "shm_names",
    "write_bytes_per_second",
    "write_burst_bytes",
    "max_registered_bytes",
    "operator",
    "retained_bytes",
}


def hash_token(token: str) -> str:
    """How the tenants file stores a bearer token: `sha256:` and the hex digest of its UTF-8 bytes."""
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Caller:
    """The credentials one call proved: a Unix peer's uid and groups, a TLS certificate subject, a token hash."""

    uid: int | None = None
    gids: frozenset[int] = frozenset()
    cert_subject: str | None = None
    token_hash: str | None = None  # sha256:<hex> of the bearer token sent, if any
    transport: str = "unix"  # "unix" or "tcp"

    def describe(self) -> str:
        """The credentials, for reasons and logs (never the token)."""
        parts = []
        if self.uid is not None:
            parts.append(f"uid {self.uid}")
        if self.cert_subject:
            parts.append(f"certificate {self.cert_subject!r}")
        if self.token_hash:
            parts.append("a bearer token")
        return ", ".join(parts) if parts else f"no credential ({self.transport})"


@dataclass(frozen=True)
class Budget:
    """A write budget: a sustained rate and a burst, in bytes."""

    bytes_per_second: int
    burst_bytes: int


@dataclass(frozen=True)
class Tenant:
    """One tenant's credentials and rights."""

    name: str
    uids: frozenset[int] = frozenset()
    gids: frozenset[int] = frozenset()
    token_hashes: tuple[bytes, ...] = ()
    cert_subjects: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = ()
    models: tuple[str, ...] | None = None  # None: any model
    admin: bool = False
    shm_names: bool = False
    budget: Budget | None = None
    max_registered_bytes: int | None = None  # None: the daemon's per-account cap
    operator: bool = False  # may pin hard and drop retentions
    retained_bytes: int = 0  # its retention budget

    def matches(self, caller: Caller) -> bool:
        """Whether the caller holds one of this tenant's credentials."""
        if caller.uid is not None and (caller.uid in self.uids or caller.gids & self.gids):
            return True
        if caller.cert_subject is not None and caller.cert_subject in self.cert_subjects:
            return True
        if caller.token_hash is not None:
            sent = caller.token_hash.encode()
            # Every stored hash is compared, in constant time each: the answer's timing says nothing about which.
            hits = [hmac.compare_digest(sent, h) for h in self.token_hashes]
            return any(hits)
        return False

    def grants(self, prefix: str, model: str) -> bool:
        """Whether sessions may open under this cache prefix for this model.

        A model right matches the model's part of the keys (its last path component), never more of the name than
        keys carry: two sessions whose keys can coincide are granted by the same rule (`org-a/Llama` and
        `org-b/Llama` share keys under one prefix, so no right can grant one and not the other)."""
        if not any(_glob(p, prefix) for p in self.prefixes):
            return False
        return self.models is None or any(_glob(m, model_key(model)) for m in self.models)


@dataclass(frozen=True)
class TenantTable:
    """Every tenant of one tenants file (or none: single-tenant), in file order."""

    tenants: tuple[Tenant, ...] = ()
    source: str = ""  # the file it came from
    by_name: dict[str, Tenant] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        self.by_name.update({t.name: t for t in self.tenants})

    @property
    def single(self) -> bool:
        """No tenants file: every caller that can reach the daemon may use any prefix."""
        return not self.source

    def describe(self) -> str:
        """One line for the start-up log and `kvsidecar status`."""
        if self.single:
            return "single-tenant (no tenants file: every socket peer may use every cache prefix)"
        n = len(self.tenants)
        return f"multi-tenant: {n} tenant{'' if n == 1 else 's'} from {self.source}"

    def of(self, caller: Caller) -> list[Tenant]:
        """The tenants whose credentials the caller holds."""
        return [t for t in self.tenants if t.matches(caller)]

    def grant(self, caller: Caller, prefix: str, model: str) -> str:
        """The name of the caller's tenant that grants this prefix and model, or Forbidden with the reason."""
        if self.single:
            return SINGLE_TENANT
        mine = self.of(caller)
        if not mine:
            raise Forbidden(f"{caller.describe()} is no tenant's credential (tenants file {self.source})")
        for t in mine:
            if t.grants(prefix, model):
                return t.name
        names = ", ".join(t.name for t in mine)
        raise Forbidden(f"tenant {names} may not open sessions under cache prefix {prefix!r} for model {model!r}")

    def admin(self, caller: Caller) -> bool:
        """Whether the caller sees every tenant (always, single-tenant)."""
        return self.single or any(t.admin for t in self.of(caller))

    def operator(self, caller: Caller) -> bool:
        """Whether the caller may pin hard and drop retentions (always, single-tenant: every socket peer is trusted)."""
        return self.single or any(t.operator for t in self.of(caller))

    def tenant_names(self) -> list[str]:
        """The names, for metric labels (bounded by the file)."""
        return [t.name for t in self.tenants]


def _glob(pattern: str, value: str) -> bool:
    # Only a trailing '*': an exact prefix "a" must not grant "ab", and no pattern language to get wrong.
    if pattern.endswith("*"):
        return value.startswith(pattern[:-1])
    return value == pattern


def parse_tenants(text: str, source: str) -> TenantTable:
    """A TenantTable from the tenants file's text; ConfigError names the first problem."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"tenants file {source} is not valid TOML: {exc}") from None
    extra = set(raw) - {"tenants"}
    if extra:
        raise ConfigError(f"tenants file {source}: unknown top-level key {sorted(extra)[0]!r} (only [tenants.NAME])")
    entries = raw.get("tenants", {})
    if not isinstance(entries, dict) or not entries:
        raise ConfigError(f"tenants file {source}: no [tenants.NAME] tables")
    tenants = [_tenant(name, body, source) for name, body in entries.items()]
    _check_unique(tenants, source)
    return TenantTable(tuple(tenants), source)


def _tenant(name: str, body: object, source: str) -> Tenant:
    where = f"tenants file {source}: tenant {name!r}"
    if not _NAME.fullmatch(name):
        raise ConfigError(f"{where}: names are 1-63 letters, digits, '.', '_' or '-'")
    if not isinstance(body, dict):
        raise ConfigError(f"{where}: must be a table")
    unknown = set(body) - _KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r}")
    uids = _ints(body.get("uids", []), f"{where}: uids")
    gids = _ints(body.get("gids", []), f"{where}: gids")
    tokens = _strings(body.get("tokens", []), f"{where}: tokens")
    for t in tokens:
        if not _TOKEN_HASH.fullmatch(t):
            raise ConfigError(f"{where}: tokens are stored hashed: 'sha256:<64 hex digits>' (kvsidecar hash-token)")
    subjects = _strings(body.get("cert_subjects", []), f"{where}: cert_subjects")
    prefixes = _strings(body.get("prefixes", []), f"{where}: prefixes")
    if not prefixes:
        raise ConfigError(f"{where}: needs prefixes (the cache prefixes it may open sessions under)")
    for p in prefixes:
        if "*" in p[:-1] or "@" in p:
            raise ConfigError(f"{where}: prefix {p!r}: '*' only at the end, and no '@'")
    models = _strings(body["models"], f"{where}: models") if "models" in body else None
    for m in models or ():
        if "/" in m or "*" in m[:-1]:
            raise ConfigError(
                f"{where}: model pattern {m!r}: models match what keys carry, the last path component of a model's "
                "name ('Llama-3*', not 'org/Llama-3*'): models of one name from two orgs share keys under a cache "
                "prefix, so separate tenants by prefixes instead; '*' only at the end"
            )
    if not (uids or gids or tokens or subjects):
        raise ConfigError(f"{where}: needs a credential (uids, gids, tokens or cert_subjects)")
    admin = _bool(body.get("admin", False), f"{where}: admin")
    operator = _bool(body.get("operator", False), f"{where}: operator")
    retained = _size(body["retained_bytes"], f"{where}: retained_bytes") if "retained_bytes" in body else 0
    if retained < 0:
        raise ConfigError(f"{where}: retained_bytes must not be negative")
    shm_names = _bool(body.get("shm_names", False), f"{where}: shm_names")
    budget = None
    if "write_bytes_per_second" in body:
        rate = _size(body["write_bytes_per_second"], f"{where}: write_bytes_per_second")
        burst = _size(body.get("write_burst_bytes", rate), f"{where}: write_burst_bytes")
        if rate < 1 or burst < 1:
            raise ConfigError(f"{where}: the write budget needs a rate and burst of at least 1 byte")
        budget = Budget(rate, burst)
    elif "write_burst_bytes" in body:
        raise ConfigError(f"{where}: write_burst_bytes needs write_bytes_per_second")
    max_registered = None
    if "max_registered_bytes" in body:
        max_registered = _size(body["max_registered_bytes"], f"{where}: max_registered_bytes")
        if max_registered < 1:
            raise ConfigError(f"{where}: max_registered_bytes must be at least 1 byte")
    return Tenant(
        name=name,
        uids=frozenset(uids),
        gids=frozenset(gids),
        token_hashes=tuple(t.encode() for t in tokens),
        cert_subjects=frozenset(subjects),
        prefixes=tuple(prefixes),
        models=tuple(models) if models is not None else None,
        admin=admin,
        shm_names=shm_names,
        budget=budget,
        max_registered_bytes=max_registered,
        operator=operator,
        retained_bytes=retained,
    )


def _check_unique(tenants: Sequence[Tenant], source: str) -> None:
    # A credential names one tenant: otherwise which tenant's budget and Stats a call gets would depend on file order.
    seen: dict[object, str] = {}
    for t in tenants:
        creds: Iterable[object] = [
            *(("uid", u) for u in t.uids),
            *(("gid", g) for g in t.gids),
            *(("token", h) for h in t.token_hashes),
            *(("subject", s) for s in t.cert_subjects),
        ]
        for c in creds:
            if c in seen:
                what = "a token" if c[0] == "token" else f"{c[0]} {c[1]!r}"  # type: ignore[index]
                raise ConfigError(f"tenants file {source}: {what} is a credential of both {seen[c]!r} and {t.name!r}")
            seen[c] = t.name


def _ints(value: object, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"{where} must be a list of integers")
    if any(v < 0 for v in value):
        raise ConfigError(f"{where} must be >= 0")
    return list(value)


def _strings(value: object, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where} must be a list of non-empty strings")
    return list(value)


def _bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false")
    return value


def _size(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{where} must be a size like 64MiB or a number of bytes")
    return parse_size(value)
