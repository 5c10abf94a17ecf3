"""The ledger's newcomers' slots (fair shares, shared/queues.py): up to `newcomer_slots` jobs beyond
the replica's slots, for callers with no job running here; none once that many are taken beyond."""

from node_agent.serving.ledger import Ledger, Running
from shared.catalog import ModelProfile
from shared.settings import NodeSettings


def running(tenant: str) -> Running:
    return Running("1-0", f"events:{tenant}", 1, tenant=tenant)


def test_newcomers_may_take_up_to_newcomer_slots_beyond_the_slots():
    book = Ledger(
        ModelProfile(id="m", source="x", slots=2), NodeSettings(newcomer_slots=2), "s", print
    )
    assert book.newcomer_slots == 2 and book.tenants() == set()
    book.admit("a1", running("alice"))
    book.admit("a2", running("alice"))
    assert book.free_slots == 0 and book.newcomer_slots == 2 and book.tenants() == {"alice"}
    book.admit("b1", running("bob"))  # a newcomer, beyond the slots
    assert book.free_slots == -1 and book.newcomer_slots == 1
    book.admit("c1", running("carol"))
    assert book.newcomer_slots == 0 and book.tenants() == {"alice", "bob", "carol"}
    book.end("a1")
    assert book.newcomer_slots == 1 and book.free_slots == -1
    none = Ledger(
        ModelProfile(id="n", source="x", slots=2), NodeSettings(newcomer_slots=0), "n", print
    )
    assert none.newcomer_slots == 0
