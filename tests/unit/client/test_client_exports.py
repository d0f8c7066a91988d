"""The public names of kvsidecar_client, pinned so a rename or a leak is a visible change."""

import types

import kvsidecar_client

PUBLIC = [
    "ClientClosed",
    "DaemonError",
    "DaemonProbe",
    "DaemonUnavailable",
    "DeadlineExceeded",
    "Deadlines",
    "EngineLayout",
    "FailedBlock",
    "GroupPlacement",
    "GroupSpec",
    "Hit",
    "InvalidRequest",
    "LoadItem",
    "LoadResult",
    "NO_BLOCK",
    "PermissionDenied",
    "PreconditionFailed",
    "Registration",
    "ResourceExhausted",
    "Retention",
    "SaveItem",
    "SaveJob",
    "SaveResult",
    "SessionInfo",
    "SessionLost",
    "SessionSpec",
    "SharedMemoryFull",
    "SidecarClient",
    "SidecarError",
    "TcpAuth",
    "Unsupported",
    "shared_tensor",
]


CONTRACT_VALUES = {"GroupSpec", "Hit"}


def test_all_is_pinned_and_sorted():
    assert kvsidecar_client.__all__ == PUBLIC
    assert sorted(kvsidecar_client.__all__) == kvsidecar_client.__all__


def test_every_public_name_is_exported_and_defined_in_the_package():
    public = {name for name in dir(kvsidecar_client) if not name.startswith("_")}
    # Submodules appear once imported (vllm and sglang among them: their pure modules are tested without either).
    modules = {
        "allocation", "batch", "client", "deadlines", "descriptions", "errors", "jobs", "layout", "memory", "probe",
        "proto", "remapping", "results", "retention", "saves", "session", "sglang", "vllm",
    }  # fmt: skip
    assert public - modules == set(PUBLIC)
    assert all(isinstance(getattr(kvsidecar_client, name), types.ModuleType) for name in public & modules)
    for name in PUBLIC:
        member = getattr(kvsidecar_client, name)
        if isinstance(member, int):  # a constant of the contract
            continue
        # The contract's own values are exported as they are: one class under one name, for daemon and client.
        home = "kvsidecar_contract." if name in CONTRACT_VALUES else "kvsidecar_client."
        assert member.__module__.startswith(home), name
    assert kvsidecar_client.NO_BLOCK == 2**32 - 1


def test_errors_form_one_hierarchy():
    for name in PUBLIC:
        member = getattr(kvsidecar_client, name)
        if isinstance(member, type) and issubclass(member, Exception):
            assert issubclass(member, kvsidecar_client.SidecarError), name
    assert issubclass(kvsidecar_client.InvalidRequest, ValueError)
    assert issubclass(kvsidecar_client.DeadlineExceeded, kvsidecar_client.DaemonUnavailable)
