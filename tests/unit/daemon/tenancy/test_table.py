"""The tenants file: parsing with precise reasons, who a credential is, what it grants; write budgets; tickets."""

import re

import pytest

from kvsidecar.errors import ConfigError, Forbidden
from kvsidecar.rpc.side import PeerCred, Tickets
from kvsidecar.tenancy.budget import WriteBudget
from kvsidecar.tenancy.table import Caller, TenantTable, hash_token, parse_tenants

TOKEN_A, TOKEN_B = "token-of-alpha", "token-of-beta"
FILE = f"""
[tenants.alpha]
uids = [1001]
tokens = ["{hash_token(TOKEN_A)}"]
prefixes = ["team-a", "team-a/*"]
models = ["llama*"]
write_bytes_per_second = "1MiB"
write_burst_bytes = "4MiB"

[tenants.beta]
gids = [2002]
tokens = ["{hash_token(TOKEN_B)}"]
cert_subjects = ["CN=engine-b"]
prefixes = ["team-b"]

[tenants.ops]
uids = [0]
prefixes = ["ops"]
admin = true
shm_names = true
operator = true
retained_bytes = "8GiB"
"""


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def table() -> TenantTable:
    return parse_tenants(FILE, "t.toml")


def test_credentials_name_their_tenant():
    t = table()
    assert [x.name for x in t.of(Caller(uid=1001))] == ["alpha"]
    assert [x.name for x in t.of(Caller(uid=5, gids=frozenset({7, 2002})))] == ["beta"]  # a supplementary group
    assert [x.name for x in t.of(Caller(token_hash=hash_token(TOKEN_B), transport="tcp"))] == ["beta"]
    assert [x.name for x in t.of(Caller(cert_subject="CN=engine-b", transport="tcp"))] == ["beta"]
    assert t.of(Caller(token_hash=hash_token(TOKEN_A + "x"), transport="tcp")) == []
    assert t.of(Caller(cert_subject="CN=engine-b,O=x", transport="tcp")) == []  # subjects match exactly
    assert t.of(Caller()) == []  # a Unix peer without a ticket is nobody


def test_grants_need_the_prefix_and_the_model():
    t = table()
    alpha = Caller(uid=1001)
    assert t.grant(alpha, "team-a", "org/llama") == "alpha"
    assert t.grant(alpha, "team-a/x", "org/llama") == "alpha"
    for prefix, model in (("team-ab", "org/llama"), ("team-b", "org/llama"), ("", "org/llama"), ("team-a", "m")):
        with pytest.raises(Forbidden, match="tenant alpha may not open sessions under cache prefix"):
            t.grant(alpha, prefix, model)
    with pytest.raises(Forbidden, match="uid 77 is no tenant's credential"):
        t.grant(Caller(uid=77), "team-a", "org/llama")
    assert t.admin(Caller(uid=0)) and not t.admin(alpha)
    assert t.operator(Caller(uid=0)) and not t.operator(alpha) and TenantTable().operator(alpha)
    assert (t.by_name["ops"].retained_bytes, t.by_name["alpha"].retained_bytes) == (8 << 30, 0)


def test_single_tenant_grants_everything():
    t = TenantTable()
    assert t.single and t.grant(Caller(), "anything", "m") == "" and t.admin(Caller())
    assert t.describe().startswith("single-tenant")


def test_the_tenancy_line_counts_tenants_in_words():
    assert table().describe() == "multi-tenant: 3 tenants from t.toml"
    one = parse_tenants('[tenants.solo]\nuids = [1]\nprefixes = ["s"]\n', "one.toml")
    assert one.describe() == "multi-tenant: 1 tenant from one.toml"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("[tenants.a]\nuids = [1]\n", "needs prefixes"),
        ('[tenants.a]\nprefixes = ["p"]\n', "needs a credential"),
        ('[tenants.a]\nuids = [1]\nprefixes = ["p"]\ntokens = ["plain-token"]\n', "tokens are stored hashed"),
        ('[tenants.a]\nuids = [1]\nprefixes = ["a*b"]\n', "'*' only at the end"),
        ('[tenants.a]\nuids = [1]\nprefixes = ["p"]\nadmin = "yes"\n', "admin must be true or false"),
        ('[tenants.a]\nuids = [1]\nprefixes = ["p"]\nuid = [2]\n', "unknown key 'uid'"),
        ('[tenants."a b"]\nuids = [1]\nprefixes = ["p"]\n', "names are 1-63 letters"),
        ('[tenants.a]\nuids = [1]\nprefixes = ["p"]\n[tenants.b]\nuids = [1]\nprefixes = ["q"]\n',
         "uid 1 is a credential of both 'a' and 'b'"),
        ('[tenants.a]\nuids = [1]\nprefixes = ["p"]\nwrite_burst_bytes = 5\n', "needs write_bytes_per_second"),
        ('[tenants.a]\nuids = [1]\nprefixes = ["p"]\nwrite_bytes_per_second = "x"\n', "not a size"),
        ('[tenants.a]\nuids = [1]\nprefixes = ["p"]\nretained_bytes = -1\n', "retained_bytes must not be negative"),
        ('[tenants.a]\nuids = [1]\nprefixes = ["p"]\noperator = 1\n', "operator must be true or false"),
        ("x = 1\n", "unknown top-level key 'x'"),
        ("[tenants\n", "not valid TOML"),
    ],
)  # fmt: skip
def test_bad_files_say_what_is_wrong(text, reason):
    with pytest.raises(ConfigError, match=reason):
        parse_tenants(text, "t.toml")


def test_budget_admits_what_fits_and_refills_at_its_rate():
    clock = Clock()
    b = WriteBudget(100, 300, clock)
    assert b.admit([100, 100, 100, 100]) == 3  # the burst
    assert b.admit([1]) == 0
    clock.now += 1.5
    assert b.admit([100, 100]) == 1  # 150 bytes refilled
    clock.now += 100
    assert b.admit([200, 200]) == 1  # never more than the burst saved up
    b.set_limits(100, 50)
    clock.now += 10
    assert b.admit([60]) == 0 and b.admit([50]) == 1


def test_tickets_are_single_use_and_expire():
    clock = Clock()
    tickets = Tickets(ttl=30, clock=clock)
    peer = PeerCred(pid=1, uid=1001, gid=1001, groups=frozenset({1001}))
    t = tickets.issue(peer)
    assert tickets.redeem(t) == peer
    assert tickets.redeem(t) is None
    late = tickets.issue(peer)
    clock.now += 31
    assert tickets.redeem(late) is None
    assert tickets.redeem("forged") is None


def test_hash_token_prints_what_the_file_stores(monkeypatch, capsys):
    import io

    from kvsidecar.cli.main import main

    monkeypatch.setattr("sys.stdin", io.StringIO(TOKEN_A + "\n"))
    assert main(["hash-token"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == hash_token(TOKEN_A) and printed in FILE


def test_a_models_right_matches_what_keys_carry_and_a_pattern_keys_cannot_separate_is_refused():
    text = '[tenants.a]\nuids = [1]\nprefixes = ["shared"]\nmodels = ["Llama*"]\n'
    t = parse_tenants(text, "t.toml")
    a = Caller(uid=1)
    # org-a/Llama-3 and org-b/Llama-3 share keys under one prefix: one rule grants both, or neither.
    assert t.grant(a, "shared", "org-a/Llama-3") == t.grant(a, "shared", "org-b/Llama-3") == "a"
    with pytest.raises(Forbidden):
        t.grant(a, "shared", "org-a/Qwen")
    for pattern in ("org-a/*", "org/Llama", "Ll*ma"):
        with pytest.raises(ConfigError, match=rf"model pattern '{re.escape(pattern)}': models match what keys carry"):
            parse_tenants(text.replace("Llama*", pattern), "t.toml")
