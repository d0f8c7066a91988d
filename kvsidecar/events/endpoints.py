"""KV-event endpoints: ZeroMQ addresses a subscriber connects to, loopback unless the operator says otherwise."""

from __future__ import annotations

from kvsidecar.fence.daemon import is_loopback_host

__all__ = ["EndpointError", "check_endpoint", "who_may_connect"]


class EndpointError(ValueError):
    """An endpoint the publisher will not bind."""


def _host_port(endpoint: str) -> tuple[str, str]:
    rest = endpoint[len("tcp://") :]
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise EndpointError(f"not a tcp://host:port endpoint: {endpoint!r}")
    return host.strip("[]"), port


def check_endpoint(endpoint: str, flag: str, remote: bool) -> None:
    """Refuse what cannot be bound or would publish off this host without `remote`."""
    if endpoint.startswith("ipc://"):
        if len(endpoint) == len("ipc://"):
            raise EndpointError(f"{flag}: an ipc:// endpoint needs a path")
        return
    if not endpoint.startswith("tcp://"):
        raise EndpointError(f"{flag} must be tcp://host:port or ipc://path, got {endpoint!r}")
    host, _ = _host_port(endpoint)
    if not remote and not is_loopback_host(host):
        # Events name every prefix the store holds: the node's cache contents, for whoever connects.
        raise EndpointError(
            f"{flag} {endpoint} is not a loopback address: KV events carry block hashes and token ids to whoever "
            "connects, without authentication; add --kv-events-remote to publish them off this host"
        )


def who_may_connect(endpoint: str) -> str:
    """The listener report's `allowed` for a bound endpoint."""
    if endpoint.startswith("ipc://"):
        return "local accounts with access to the socket file"
    host, _ = _host_port(endpoint)
    if is_loopback_host(host):
        return "local accounts (loopback); no authentication"
    return "any address; no authentication (read-only KV events)"
