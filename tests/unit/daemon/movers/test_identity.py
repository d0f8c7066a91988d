"""A rank's GPU found among the daemon's by its UUID, whatever CUDA_VISIBLE_DEVICES each process runs with.

The table simulates CUDA's visible-device rule (a comma list of indices or UUIDs, None for every GPU) for the daemon
and for the rank; the rank names its tensor's device (its own index) and that device's UUID as torch spells it, and
the daemon must open the memory on the very same physical GPU, or refuse one it does not see, saying why.
"""

from __future__ import annotations

import pytest

from kvsidecar.errors import BadRequest
from kvsidecar.movers.identity import normalized_uuid, ordinal_of

PHYSICAL = [f"{k:08x}-1111-2222-3333-{k:012x}" for k in range(8)]  # torch's uuid: no "GPU-" prefix


def visible(setting: str | None) -> list[int]:
    """The physical GPUs a process sees, in its own order, under CUDA_VISIBLE_DEVICES=setting."""
    if setting is None:
        return list(range(len(PHYSICAL)))
    out = []
    for entry in setting.split(","):
        entry = entry.strip()
        if entry.startswith("GPU-"):
            matches = [k for k, u in enumerate(PHYSICAL) if u.startswith(entry.removeprefix("GPU-"))]
            if len(matches) != 1:
                break
            out.append(matches[0])
        elif entry.isdigit() and int(entry) < len(PHYSICAL):
            out.append(int(entry))
        else:
            break  # CUDA ignores the list from the first entry it cannot use
    return out


@pytest.mark.parametrize(
    ("daemon", "rank", "index"),
    [
        (None, None, 3),  # nobody restricted: the same numbering
        (None, "3", 0),  # one GPU per rank process (Ray): every rank says cuda:0
        (None, "5,6", 1),
        ("2,3", "3", 0),  # the daemon restricted too: its own index for GPU 3 is 1
        ("4,0", "0", 0),  # the daemon's order is its own
        (None, f"GPU-{PHYSICAL[4][:8]}", 0),  # a Kubernetes device plugin names GPUs by UUID
        ("1,2,3,4,5,6,7,0", "0", 0),
    ],
)
def test_the_daemon_opens_a_ranks_memory_on_the_same_physical_gpu(daemon, rank, index):
    seen = [PHYSICAL[k] for k in visible(daemon)]
    physical = visible(rank)[index]
    ordinal = ordinal_of(PHYSICAL[physical], index, seen)
    assert visible(daemon)[ordinal] == physical


def test_a_gpu_the_daemon_does_not_see_is_refused_with_what_it_sees():
    seen = [PHYSICAL[k] for k in visible("2,3")]
    refusal = r"GPU 00000005-.* \(the rank's cuda:0\), which this daemon does not see"
    with pytest.raises(BadRequest, match=refusal) as e:
        ordinal_of(PHYSICAL[visible("5")[0]], 0, seen)
    assert f"cuda:0 {PHYSICAL[2]}, cuda:1 {PHYSICAL[3]}" in str(e.value)


def test_nvidia_smis_spelling_is_the_same_gpu():
    assert ordinal_of(f"GPU-{PHYSICAL[6].upper()}", 0, PHYSICAL) == 6
    assert normalized_uuid(f" GPU-{PHYSICAL[1].upper()} ") == PHYSICAL[1]


def test_a_client_that_sends_no_uuid_is_read_only_where_that_cannot_be_wrong():
    assert ordinal_of("", 0, [PHYSICAL[3]]) == 0  # the daemon sees one GPU: there is no other
    with pytest.raises(BadRequest, match=r"without the GPU's UUID: this daemon sees 8 GPUs.*update kvsidecar_client"):
        ordinal_of("", 0, PHYSICAL)
