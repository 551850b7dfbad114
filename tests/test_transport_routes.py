"""Which GPU pairs jax_ep.initialize sends through NCCL instead of peer stores (runs on CPU, stand-in GPUs)."""

import json
from types import SimpleNamespace

import jax
import pytest

from jax_ep import _group

GROUP = 3  # the id of the initialize call whose keys the processes swap


class FakeStore:
    """jax.distributed's key-value client, as far as initialize uses it."""

    def __init__(self, entries=None):
        self.entries = dict(entries or {})

    def key_value_set(self, key, value):
        self.entries[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        if key not in self.entries:
            raise TimeoutError(f"{key} not set within {timeout_ms} ms")
        return self.entries[key]


def gpus(*processes):
    """Stand-in GPUs: the i-th lives in process processes[i] and is its local GPU i."""
    return [SimpleNamespace(process_index=p, local_hardware_id=i) for i, p in enumerate(processes)]


@pytest.fixture
def no_p2p(monkeypatch):
    """Ordinal pairs without P2P (both directions); every other pair has it."""
    missing = set()
    fake = SimpleNamespace(can_access_peer=lambda a, b: (a, b) not in missing and (b, a) not in missing)
    monkeypatch.setattr(_group, "_extension", fake)
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    return missing


def pairs(groups, transport="auto", client=None):
    me = jax.process_index()
    local = [(g, r, d) for g, group in enumerate(groups) for r, d in enumerate(group) if d.process_index == me]
    return _group._nccl_pairs(GROUP, groups, local, transport, client, timeout_s=1.0)


def nccl_set(routes):
    return {(g, a, b) for g, group in enumerate(routes) for a, row in enumerate(group) for b, v in enumerate(row) if v}


def test_one_process_with_p2p_uses_peer_stores_everywhere(no_p2p):
    assert nccl_set(pairs([gpus(0, 0, 0, 0)])) == set()


def test_transport_nccl_sends_every_pair_of_distinct_gpus_through_nccl(no_p2p):
    routes = pairs([gpus(0, 0, 0)], transport="nccl")
    assert nccl_set(routes) == {(0, a, b) for a in range(3) for b in range(3) if a != b}


@pytest.mark.parametrize("value,through_nccl", [("1", True), ("0", False), ("", False)])
def test_nccl_p2p_disable_is_honoured(no_p2p, monkeypatch, value, through_nccl):
    monkeypatch.setenv("NCCL_P2P_DISABLE", value)
    assert nccl_set(pairs([gpus(0, 0)])) == ({(0, 0, 1), (0, 1, 0)} if through_nccl else set())


def test_a_pair_without_p2p_goes_through_nccl_and_the_rest_keeps_peer_stores(no_p2p):
    no_p2p.add((0, 1))
    groups = [gpus(0, 0, 0, 0)[:2], gpus(0, 0, 0, 0)[2:]]  # two groups: GPUs 0,1 and GPUs 2,3
    assert nccl_set(pairs(groups)) == {(0, 0, 1), (0, 1, 0)}


def test_other_hosts_go_through_nccl_and_the_same_host_by_peer_stores(no_p2p, monkeypatch):
    monkeypatch.setattr(_group.socket, "gethostname", lambda: "host-a")
    store = FakeStore({_group._key(GROUP, "facts", 1): json.dumps({"host": "host-b", "force": False, "no_p2p": []})})
    routes = pairs([gpus(0, 0, 1, 1)], client=store)
    cross = {(0, a, b) for a in range(4) for b in range(4) if (a < 2) != (b < 2)}
    assert nccl_set(routes) == cross
    assert json.loads(store.entries[_group._key(GROUP, "facts", 0)])["host"] == "host-a"  # published for process 1


def test_another_process_reports_its_own_pairs_without_p2p(no_p2p, monkeypatch):
    monkeypatch.setattr(_group.socket, "gethostname", lambda: "host-a")
    facts = {"host": "host-a", "force": False, "no_p2p": [[0, 2, 3], [0, 3, 2]]}
    routes = pairs([gpus(0, 0, 1, 1)], client=FakeStore({_group._key(GROUP, "facts", 1): json.dumps(facts)}))
    assert nccl_set(routes) == {(0, 2, 3), (0, 3, 2)}


def test_processes_that_disagree_on_transport_are_an_error(no_p2p, monkeypatch):
    monkeypatch.setattr(_group.socket, "gethostname", lambda: "host-a")
    facts = {"host": "host-a", "force": True, "no_p2p": []}
    with pytest.raises(ValueError, match="processes disagree on sending every pair through NCCL"):
        pairs([gpus(0, 1)], client=FakeStore({_group._key(GROUP, "facts", 1): json.dumps(facts)}))


def test_a_process_that_never_initializes_is_named(no_p2p):
    with pytest.raises(RuntimeError, match="process 1 did not call jax_ep.initialize"):
        pairs([gpus(0, 1)], client=FakeStore())


def test_facts_of_another_initialize_call_are_not_used(no_p2p, monkeypatch):
    """Keys carry the group id: what process 1 published for another initialize call is not this call's."""
    monkeypatch.setattr(_group.socket, "gethostname", lambda: "host-a")
    facts = {"host": "host-a", "force": False, "no_p2p": []}
    other_call = FakeStore({_group._key(GROUP + 1, "facts", 1): json.dumps(facts)})
    with pytest.raises(RuntimeError, match="process 1 did not call jax_ep.initialize"):
        pairs([gpus(0, 1)], client=other_call)
    assert _group._key(GROUP, "facts", 0) in other_call.entries  # this call published under its own id
