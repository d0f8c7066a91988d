"""`kvsidecar layout` through the command's entry point, in this process: its output is a function of its flags
(the console script as a real process, its exit statuses and a reader that leaves: test_command_line.py)."""

import contextlib
import io
import json
import re
import subprocess

import pytest

from kvsidecar.cli.main import main


def run(*args: str) -> subprocess.CompletedProcess[str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["layout", *args])
    return subprocess.CompletedProcess(["kvsidecar", "layout", *args], code, out.getvalue(), err.getvalue())


def test_json_for_example_a():
    out = run(
        "--tp", "4", "--kv-heads", "2", "--groups", "mla,full_attention,mamba,uniform(mla+full_attention)", "--json"
    )
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    groups = info["groups"]
    assert [g["index"] for g in groups] == [0, 1, 2, 3]
    assert [g["kind"] for g in groups] == ["mla", "full_attention", "mamba", "uniform"]
    assert [g["replication_factor"] for g in groups] == [4, 2, 1, 2]
    assert [g["keys_per_boundary"] for g in groups] == [1, 2, 4, 2]
    assert [g["shard_of_rank"] for g in groups] == [[0, 0, 0, 0], [0, 0, 1, 1], [0, 1, 2, 3], [0, 0, 1, 1]]
    assert [g["writers_of_chunk0"] for g in groups] == [[0], [1, 3], [0, 1, 2, 3], [1, 3]]
    zero = "00" * 32
    assert groups[2]["example_key_of_rank"] == [f"kvs1@@{info['model_key']}@s{r}.c0.d0.p0.g2@{zero}" for r in range(4)]


def test_json_with_dcp_pp_pcp_prefix_and_model():
    out = run(
        "--tp", "4", "--dcp", "2", "--pp", "2", "--pcp", "2", "--groups", "mla,sliding_window:4096",
        "--model", "org/Kimi", "--cache-prefix", "tenant-a", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["groups"][1]["kind"] == "sliding_window"
    assert info["groups"][1]["window"] == 4096
    # (T, C, D) = (4, 2, 2): vLLM's DCP group spans the PCP axis, so a rank's DCP rank is its PCP rank and the four
    # TP ranks of one PCP rank hold the same slice (one KV head, or the latent): one namespace per PCP rank and
    # stage. (Before, every group had factor 1 under DCP and the DCP rank was taken as r mod D: 16 namespaces, and
    # rank 3's key named dcp1, a slice vLLM never gives it.)
    assert [g["keys_per_boundary"] for g in info["groups"]] == [4, 4]
    assert (
        info["groups"][0]["example_key_of_rank"][3] == f"kvs1@tenant-a@{info['model_key']}@s0.c0.d0.p0.g0@{'00' * 32}"
    )
    assert info["model_key"].startswith("Kimi~")


def test_the_value_identity_changes_every_key():
    args = ("--tp", "2", "--kv-heads", "2", "--groups", "full_attention", "--json")
    plain, pinned = (json.loads(run(*args, *extra).stdout) for extra in ((), ("--value-identity", "ab12")))
    assert plain["model_key"] != pinned["model_key"]
    assert pinned["groups"][0]["example_key_of_rank"][0].startswith(f"kvs1@@{pinned['model_key']}@")


def test_table_is_readable():
    out = run("--tp", "2", "--groups", "mla,mamba")
    assert out.returncode == 0
    assert "replication" not in out.stderr
    assert "keys/boundary" in out.stdout and "mamba" in out.stdout


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (("--tp", "4", "--dcp", "3"), "--dcp 3 must divide --tp 4"),
        (("--groups", "attention"), "unknown group kind 'attention'"),
        (("--tp", "0"), "--tp must be in [1, 1024]"),
        (("--model", "a@b"), "must not contain '@'"),
        # The flags, not the placement rules' parameter names (num_kv_heads, tp_size); the reader's TP is its own.
        (("--tp", "3", "--kv-heads", "2"), ": --kv-heads 2 and --tp 3 must divide one another"),
        (("--tp", "2", "--kv-heads", "2", "--reader-tp", "3"), ": --kv-heads 2 and --reader-tp 3 must divide one"),
        (("--block-size", "0"), ": --block-size must be in"),
    ],
)
def test_invalid_layouts_exit_nonzero_with_one_line(args, reason):
    out = run(*args)
    assert out.returncode != 0
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and reason in lines[0]


def test_the_header_names_the_value_id_every_key_carries():
    """Groups shared across TP sizes carry their own value ids: the header shows those, never the layout's."""
    out = run("--tp", "4", "--kv-heads", "8", "--share-across-tp", "--reader-tp", "2")
    assert out.returncode == 0, out.stderr
    header = out.stdout.splitlines()[0]
    keys = re.findall(r"kvs1@@([^@]+)@", out.stdout)
    assert keys and set(keys) == {header.split()[1]}, (header, set(keys))
    mixed = run("--tp", "2", "--kv-heads", "2", "--groups", "mla,full_attention,mamba", "--share-across-tp").stdout
    assert mixed.startswith("model model (value id per group: see its keys)  tp 2"), mixed
    assert len(set(re.findall(r"kvs1@@([^@]+)@", mixed))) == 3


def test_each_key_is_labelled_with_the_ranks_that_hold_it_and_its_writer():
    out = run("--tp", "4", "--kv-heads", "2", "--groups", "mla,full_attention,mamba/64")
    assert out.returncode == 0, out.stderr
    labels = [line.split(": kvs1@@")[0] for line in out.stdout.splitlines() if ": kvs1@@" in line]
    assert labels == [
        "  group 0 held by ranks 0 1 2 3, written by 0",
        "  group 1 held by ranks 0 1, written by 1",  # the writers the table names: 1 and 3
        "  group 1 held by ranks 2 3, written by 3",
        *(f"  group 2 held by rank {r}, written by {r}" for r in range(4)),
    ]
    assert "group  kind            span  factor  keys/boundary  shard of rank  writers of chunk 0" in out.stdout
    assert "1      full_attention  16    2       2              0 0 1 1        1 3" in out.stdout


def test_a_reader_of_another_tp_size_sees_who_wrote_each_value():
    out = run(
        "--tp", "2", "--kv-heads", "2", "--groups", "mla,full_attention,mamba", "--share-across-tp",
        "--reader-tp", "4", "--model", "org/Llama", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert [g["shared_across_tp"] for g in info["groups"]] == [True, True, False]
    assert [g["values_per_block"] for g in info["groups"]] == [1, 1, 1]
    groups = info["reader"]["groups"]
    # MLA: every reader rank loads the one latent value, written by writer rank 0 (chunk 0's stripe, rule 4).
    assert {v["written_by"] for r in groups[0]["reads"] for v in r["values"]} == {0}
    # GQA: reader ranks 0, 1 hold head 0 (written by writer rank 0), ranks 2, 3 head 1 (writer rank 1).
    assert [[v["written_by"] for v in r["values"]] for r in groups[1]["reads"]] == [[0], [0], [1], [1]]
    assert [r["values"][0]["key"].split("@")[3][:2] for r in groups[1]["reads"]] == ["s0", "s0", "s1", "s1"]
    # Mamba stays per layout: nobody wrote what a TP=4 reader would load.
    assert {v["written_by"] for r in groups[2]["reads"] for v in r["values"]} == {None}
    table = run("--tp", "1", "--kv-heads", "2", "--share-across-tp", "--reader-tp", "2").stdout
    assert "reader rank 1: kvs1@@model~" in table and "<- written by tp rank 0" in table


HYBRID = (
    "--tp",
    "2",
    "--kv-heads",
    "2",
    "--groups",
    "full_attention,mamba2(heads=4,head_dim=2,state=2,groups=1,conv=4)",
)


def test_the_state_pieces_of_a_hybrid_who_writes_them_and_who_reads_them():
    out = run(*HYBRID, "--share-across-tp", "--reader-tp", "4", "--model", "M")
    assert out.returncode == 0, out.stderr
    pieces = out.stdout.split("recurrent state in pieces")[1].split("\n\n")[0]
    assert pieces == (
        " every TP size reads (rule 12), chunk 0:\n"
        "  group 1 (mamba[heads=4,groups=1]): 5 pieces per block, 64 bytes of state per layer on a rank\n"
        "    s0  heads 0   20 B/layer  held by tp rank 0     written by 0\n"
        "    s1  heads 1   20 B/layer  held by tp rank 0     written by 0\n"
        "    s2  heads 2   20 B/layer  held by tp rank 1     written by 1\n"
        "    s3  heads 3   20 B/layer  held by tp rank 1     written by 1\n"
        "    s4  groups 0  24 B/layer  held by tp ranks 0 1  written by 1"
    )
    # A TP=4 reader: each rank reads its one head and the group every rank repeats, all written at TP=2.
    reads = out.stdout.split("  group 1 (mamba[heads=4,groups=1], shared across TP sizes)\n")[1].splitlines()
    key = "kvs1@@M~c9b18f90f3da811807e97e1a@s{}.c0.d0.p0.g1@" + "00" * 32
    assert reads == [
        line
        for r, writer in enumerate((0, 0, 1, 1))
        for line in (
            f"    reader rank {r}: {key.format(r)} (heads {r})  <- written by tp rank {writer}",
            f"    reader rank {r}: {key.format(4)} (groups 0)  <- written by tp rank 1",
        )
    ]


def test_state_pieces_in_json_and_per_layout_state_without_sharing():
    info = json.loads(run(*HYBRID, "--share-across-tp", "2", "--reader-tp", "1", "--json").stdout)
    state = info["groups"][1]["state"]
    assert state["axes"] == [
        {"name": "heads", "size": 4, "repeat": False},
        {"name": "groups", "size": 1, "repeat": True},
    ]
    assert [(p["shard"], p["piece"], p["held_by"], p["writer_of_chunk0"]) for p in state["pieces"]] == [
        (0, "heads 0-1", [0], 0),
        (1, "heads 2-3", [1], 1),
        (2, "groups 0", [0, 1], 1),
    ]
    assert [(p["bytes_per_layer"]) for p in state["pieces"]] == [40, 40, 24]
    reads = info["reader"]["groups"][1]["reads"]
    assert [[(v["piece"], v["written_by"]) for v in r["values"]] for r in reads] == [
        [("heads 0-1", 0), ("heads 2-3", 1), ("groups 0", 1)]
    ]
    plain = json.loads(run(*HYBRID, "--reader-tp", "1", "--json").stdout)
    assert "pieces" not in plain["groups"][1]["state"] and plain["groups"][1]["state"]["layer_bytes_of_rank"] == 64
    assert {v["written_by"] for r in plain["reader"]["groups"][1]["reads"] for v in r["values"]} == {None}


@pytest.mark.parametrize(
    ("groups", "extra", "reason"),
    [
        ("mamba2(heads=4)", (), "mamba2(...) needs head_dim, state, groups, conv"),
        ("mamba2(heads=4,head_dim=2,state=2,groups=1,conv=4,colour=red)", (), "mamba2(...) takes heads=N"),
        ("gdn(k_heads=2,v_heads=4,k_dim=2,v_dim=2,conv=4,layout=xy)", (), "layout must be sd or ds"),
        ("mamba2(heads=3,head_dim=2,state=2,groups=1,conv=4)", (), "state axis heads of 3 cannot be sharded over 2"),
        ("kda(heads=8,head_dim=2,conv=4)", ("--share-across-tp", "1"), "a TP=2 rank holds 4, not a whole number"),
    ],
)
def test_state_layers_that_cannot_be_read_or_cut_exit_with_the_reason(groups, extra, reason):
    out = run("--tp", "2", "--groups", groups, *extra)
    assert out.returncode != 0 and out.stdout == ""
    assert reason in out.stderr.strip()
