"""Which GPU pairs jax_ep.initialize sends through NCCL instead of peer stores (runs on CPU, stand-in GPUs)."""

import dataclasses
import json
import threading

import jax
import pytest

from jax_ep.ep import group as _group

GROUP = 3  # the id of the group in this process
NAMESPACE = "axis/1"  # the key-value namespace of the initialize call whose keys the processes swap
_thread = threading.local()  # the stand-in process a thread runs as: index and host name


class FakeStore:
    """jax.distributed's key-value client, as far as initialize uses it; ``wait_s`` > 0 lets threads wait."""

    def __init__(self, entries=None, wait_s=0.0):
        self.entries = dict(entries or {})
        self.log = []  # keys in the order they were set
        self.wait_s = wait_s
        self.changed = threading.Condition()

    def key_value_set(self, key, value):
        with self.changed:
            assert key not in self.entries, f"{key} set twice"
            self.entries[key] = value
            self.log.append(key)
            self.changed.notify_all()

    def blocking_key_value_get(self, key, timeout_ms):
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.entries, timeout=self.wait_s):
                raise TimeoutError(f"{key} not set within {timeout_ms} ms")
            return self.entries[key]

    key_value_set_bytes = key_value_set
    blocking_key_value_get_bytes = blocking_key_value_get

    def wait_at_barrier(self, key, timeout_ms, process_ids):
        pass


class FakeExtension:
    """The CUDA extension, as far as _connect uses it. Stand-in handles name their GPU: b"gpu2"."""

    def __init__(self):
        self.no_p2p = set()  # (ordinal, peer): can_access_peer says no, in that direction only
        self.unopenable = set()  # (ordinal, peer): GPU ordinal cannot open peer's handles, in that direction only
        self.probes = set()  # (process, ordinal, peer) of every can_open_handles call
        self.connected = {}  # ordinal: (handles, by_nccl) given to connect
        self.nccl_members = {}  # process: ordinals given to connect_nccl
        self.lock = threading.Lock()

    def allocate(self, group, ordinal, *sizes):
        pass

    def export_handles(self, group, ordinal):
        return b"gpu%d" % ordinal

    def can_access_peer(self, ordinal, peer):
        return (ordinal, peer) not in self.no_p2p

    def can_open_handles(self, group, ordinal, handles):
        assert group == GROUP
        peer = int(handles.removeprefix(b"gpu"))
        with self.lock:
            self.probes.add((jax.process_index(), ordinal, peer))
        return (ordinal, peer) not in self.unopenable

    def connect(self, group, ordinal, ordinals, handles, by_nccl):
        with self.lock:
            self.connected[ordinal] = (list(handles), list(by_nccl))

    def nccl_unique_id(self):
        return b"id"

    def connect_nccl(self, group, ordinals, unique_ids, timeout_ms, setup_timeout_ms):
        with self.lock:
            self.nccl_members[jax.process_index()] = list(ordinals)

    def commit(self, group):
        return 132


@pytest.fixture
def fake(monkeypatch):
    """The fake extension; the calling thread runs as process 0 on host-a unless it says otherwise."""
    extension = FakeExtension()
    monkeypatch.setattr(_group, "_extension", extension)
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    monkeypatch.setattr(jax, "process_index", lambda: getattr(_thread, "index", 0))
    monkeypatch.setattr(_group.socket, "gethostname", lambda: getattr(_thread, "host", "host-a"))
    return extension


@dataclasses.dataclass(frozen=True)
class Gpu:
    process_index: int
    local_hardware_id: int


def gpus(*processes):
    """Stand-in GPUs: the i-th lives in process processes[i] and is its local GPU i."""
    return [Gpu(p, i) for i, p in enumerate(processes)]


def pairs(groups, transport="auto", client=None):
    me = jax.process_index()
    local = [(g, r, d) for g, group in enumerate(groups) for r, d in enumerate(group) if d.process_index == me]
    return _group._nccl_pairs(GROUP, NAMESPACE, groups, local, transport, client, timeout_s=1.0)


def nccl_set(routes):
    return {(g, a, b) for g, group in enumerate(routes) for a, row in enumerate(group) for b, v in enumerate(row) if v}


def run_processes(monkeypatch, groups, hosts, transport="auto"):
    """Runs _connect as every process of the mesh, each in its own thread, against one store.

    Returns the store and, for each process, the routes it decided (``nccl_set``) and what _connect returned.
    """
    store = FakeStore(wait_s=10.0)
    monkeypatch.setattr(_group, "_key_value_client", lambda: store)
    decide = _group._nccl_pairs
    routes, reached, errors = {}, {}, []

    def spy(*args, **kwargs):
        result = decide(*args, **kwargs)
        routes[jax.process_index()] = nccl_set(result)
        return result

    monkeypatch.setattr(_group, "_nccl_pairs", spy)

    def run(process):
        _thread.index, _thread.host = process, hosts[process]
        try:
            reached[process] = _group._connect(GROUP, NAMESPACE, groups, 1024, 64, 0, sorted(hosts), 1.0, transport)[1]
        except BaseException as error:  # re-raised in the main thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(process,)) for process in sorted(hosts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]
    return store, routes, reached


def test_one_process_with_p2p_uses_peer_stores_everywhere(fake):
    assert nccl_set(pairs([gpus(0, 0, 0, 0)])) == set()


def test_transport_nccl_sends_every_pair_of_distinct_gpus_through_nccl(fake):
    routes = pairs([gpus(0, 0, 0)], transport="nccl")
    assert nccl_set(routes) == {(0, a, b) for a in range(3) for b in range(3) if a != b}


@pytest.mark.parametrize("value,through_nccl", [("1", True), ("0", False), ("", False)])
def test_nccl_p2p_disable_is_honoured(fake, monkeypatch, value, through_nccl):
    monkeypatch.setenv("NCCL_P2P_DISABLE", value)
    assert nccl_set(pairs([gpus(0, 0)])) == ({(0, 0, 1), (0, 1, 0)} if through_nccl else set())


def test_a_pair_without_p2p_goes_through_nccl_and_the_rest_keeps_peer_stores(fake):
    fake.no_p2p |= {(0, 1), (1, 0)}
    groups = [gpus(0, 0, 0, 0)[:2], gpus(0, 0, 0, 0)[2:]]  # two groups: GPUs 0,1 and GPUs 2,3
    assert nccl_set(pairs(groups)) == {(0, 0, 1), (0, 1, 0)}


@pytest.mark.parametrize("direction", [(1, 2), (2, 1)])
def test_p2p_missing_in_one_direction_within_a_process_sends_both_through_nccl(fake, direction):
    fake.no_p2p.add(direction)  # can_access_peer(a, b) is True, but (b, a) False
    assert nccl_set(pairs([gpus(0, 0, 0, 0)])) == {(0, 1, 2), (0, 2, 1)}


def test_decide_transports_is_symmetric_whoever_reports_a_pair(fake):
    groups = [gpus(0, 0, 1, 1)]
    facts = {0: {"host": "h", "no_p2p": []}, 1: {"host": "h", "no_p2p": [[0, 3, 0]]}}
    assert nccl_set(_group.decide_transports(groups, facts, force=False)) == {(0, 0, 3), (0, 3, 0)}
    facts[1]["host"] = "other"
    cross = {(0, a, b) for a in range(4) for b in range(4) if (a < 2) != (b < 2)}
    assert nccl_set(_group.decide_transports(groups, facts, force=False)) == cross
    every = {(0, a, b) for a in range(4) for b in range(4) if a != b}
    assert nccl_set(_group.decide_transports(groups, {0: {"host": "h", "no_p2p": []}}, force=True)) == every


@pytest.mark.parametrize("direction", [(1, 2), (2, 1)])
def test_processes_of_one_host_send_a_pair_whose_handles_fail_to_open_one_way_through_nccl(
    fake, monkeypatch, direction
):
    fake.unopenable.add(direction)  # GPU 1 (process 0) and GPU 2 (process 1): one of them cannot map the other
    store, routes, reached = run_processes(monkeypatch, [gpus(0, 0, 1, 1)], {0: "host-a", 1: "host-a"})
    assert routes == {0: {(0, 1, 2), (0, 2, 1)}, 1: {(0, 1, 2), (0, 2, 1)}}
    devices = gpus(0, 0, 1, 1)
    assert reached == {0: {devices[0]: (), devices[1]: (2,)}, 1: {devices[2]: (1,), devices[3]: ()}}
    # Each process probed every pair of its GPUs with the other process's, and nothing else.
    assert fake.probes == {(0, a, b) for a in (0, 1) for b in (2, 3)} | {(1, a, b) for a in (2, 3) for b in (0, 1)}
    # connect got the other process's handles and each GPU's row; both processes joined NCCL with all their GPUs.
    assert fake.connected == {
        0: ([b"", b"", b"gpu2", b"gpu3"], [False, False, False, False]),
        1: ([b"", b"", b"gpu2", b"gpu3"], [False, False, True, False]),
        2: ([b"gpu0", b"gpu1", b"", b""], [False, True, False, False]),
        3: ([b"gpu0", b"gpu1", b"", b""], [False, False, False, False]),
    }
    assert fake.nccl_members == {0: [0, 1], 1: [2, 3]}
    # The handles were published before the transport decision (the facts).
    for process, gpu_ids in ((0, (0, 1)), (1, (2, 3))):
        facts_at = store.log.index(_group._key(NAMESPACE, "facts", process))
        assert all(store.log.index(_group._key(NAMESPACE, "handles", 0, r)) < facts_at for r in gpu_ids)


def test_processes_of_one_host_that_open_each_others_handles_use_peer_stores(fake, monkeypatch):
    groups = [[gpus(0, 0, 1, 1)[0], gpus(0, 0, 1, 1)[2]], [gpus(0, 0, 1, 1)[1], gpus(0, 0, 1, 1)[3]]]
    _, routes, reached = run_processes(monkeypatch, groups, {0: "host-a", 1: "host-a"})
    assert routes == {0: set(), 1: set()}
    assert fake.probes == {(0, 0, 2), (0, 1, 3), (1, 2, 0), (1, 3, 1)}  # within each group only
    assert fake.connected == {
        0: ([b"", b"gpu2"], [False, False]),
        1: ([b"", b"gpu3"], [False, False]),
        2: ([b"gpu0", b""], [False, False]),
        3: ([b"gpu1", b""], [False, False]),
    }
    assert fake.nccl_members == {}


def test_processes_of_different_hosts_use_nccl_without_probing(fake, monkeypatch):
    store, routes, reached = run_processes(monkeypatch, [gpus(0, 0, 1, 1)], {0: "host-a", 1: "host-b"})
    cross = {(0, a, b) for a in range(4) for b in range(4) if (a < 2) != (b < 2)}
    assert routes == {0: cross, 1: cross}
    assert fake.probes == set()
    assert not any("probes" in key for key in store.log)  # no second round
    assert fake.connected[0] == ([b""] * 4, [False, False, True, True])
    assert fake.connected[3] == ([b""] * 4, [True, True, False, False])
    assert fake.nccl_members == {0: [0, 1], 1: [2, 3]}


def test_processes_probe_only_the_gpus_of_their_own_host(fake, monkeypatch):
    hosts = {0: "host-a", 1: "host-a", 2: "host-b"}
    _, routes, _ = run_processes(monkeypatch, [gpus(0, 1, 2, 2)], hosts)
    cross = {(0, a, b) for a in range(4) for b in range(4) if (a < 2) != (b < 2)}
    assert routes == {0: cross, 1: cross, 2: cross}
    assert fake.probes == {(0, 0, 1), (1, 1, 0)}
    assert fake.connected[0] == ([b"", b"gpu1", b"", b""], [False, False, True, True])
    assert fake.connected[2] == ([b""] * 4, [True, True, False, False])


def test_transport_nccl_across_processes_of_one_host_probes_nothing(fake, monkeypatch):
    _, routes, _ = run_processes(monkeypatch, [gpus(0, 1)], {0: "host-a", 1: "host-a"}, transport="nccl")
    assert routes == {0: {(0, 0, 1), (0, 1, 0)}, 1: {(0, 0, 1), (0, 1, 0)}}
    assert fake.probes == set()


def test_other_hosts_go_through_nccl_and_the_same_host_by_peer_stores(fake):
    facts = {"host": "host-b", "force": False, "no_p2p": []}
    store = FakeStore({_group._key(NAMESPACE, "facts", 1): json.dumps(facts)})
    routes = pairs([gpus(0, 0, 1, 1)], client=store)
    cross = {(0, a, b) for a in range(4) for b in range(4) if (a < 2) != (b < 2)}
    assert nccl_set(routes) == cross
    assert json.loads(store.entries[_group._key(NAMESPACE, "facts", 0)])["host"] == "host-a"  # published for process 1


def process_1_of_host_a(facts=None, probes=None, handles=True):
    """A store holding what process 1 (GPUs 2 and 3, on host-a) published."""
    facts = facts or {"host": "host-a", "force": False, "no_p2p": []}
    entries = {_group._key(NAMESPACE, "facts", 1): json.dumps(facts)}
    if handles:
        entries.update({_group._key(NAMESPACE, "handles", 0, r): b"gpu%d" % r for r in (2, 3)})
    if probes is not None:
        entries[_group._key(NAMESPACE, "probes", 1)] = json.dumps(probes)
    return FakeStore(entries)


def test_another_process_reports_its_own_pairs_without_p2p(fake):
    facts = {"host": "host-a", "force": False, "no_p2p": [[0, 2, 3], [0, 3, 2]]}
    routes = pairs([gpus(0, 0, 1, 1)], client=process_1_of_host_a(facts, probes=[]))
    assert nccl_set(routes) == {(0, 2, 3), (0, 3, 2)}


def test_another_process_that_cannot_open_our_handles_makes_the_pair_nccl(fake):
    store = process_1_of_host_a(probes=[[0, 3, 0]])  # GPU 3 could not map GPU 0
    assert nccl_set(pairs([gpus(0, 0, 1, 1)], client=store)) == {(0, 0, 3), (0, 3, 0)}
    assert fake.probes == {(0, a, b) for a in (0, 1) for b in (2, 3)}
    assert json.loads(store.entries[_group._key(NAMESPACE, "probes", 0)]) == []


def test_a_process_that_never_publishes_its_probes_is_named(fake):
    with pytest.raises(RuntimeError, match="process 1 did not finish probing P2P"):
        pairs([gpus(0, 0, 1, 1)], client=process_1_of_host_a())


def test_a_process_that_never_publishes_its_handles_is_named(fake):
    with pytest.raises(RuntimeError, match=r"rank 2 .*process 1\) did not publish its buffers"):
        pairs([gpus(0, 0, 1, 1)], client=process_1_of_host_a(probes=[], handles=False))


def test_processes_that_disagree_on_transport_are_an_error(fake):
    facts = {"host": "host-a", "force": True, "no_p2p": []}
    with pytest.raises(ValueError, match="processes disagree on sending every pair through NCCL"):
        pairs([gpus(0, 1)], client=FakeStore({_group._key(NAMESPACE, "facts", 1): json.dumps(facts)}))


def test_a_process_that_never_initializes_is_named(fake):
    with pytest.raises(RuntimeError, match="process 1 did not call jax_ep.initialize"):
        pairs([gpus(0, 1)], client=FakeStore())


def test_facts_of_another_initialize_call_are_not_used(fake):
    """Keys carry the call's namespace: what process 1 published for another initialize call is not this call's."""
    facts = {"host": "host-a", "force": False, "no_p2p": []}
    other_call = FakeStore({_group._key("axis/2", "facts", 1): json.dumps(facts)})
    with pytest.raises(RuntimeError, match="process 1 did not call jax_ep.initialize"):
        pairs([gpus(0, 1)], client=other_call)
    assert _group._key(NAMESPACE, "facts", 0) in other_call.entries  # this call published under its own namespace
