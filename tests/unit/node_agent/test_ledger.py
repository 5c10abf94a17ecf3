"""The ledger's slots kept for newcomers (fair shares, shared/queues.py): none while one caller alone
has been served here (a single user's burst keeps every slot), `newcomer_slots` (at most the slots
less one) once two callers were, until the other caller has not been seen for TENANTS_SEEN_S."""

from node_agent.serving import ledger
from node_agent.serving.ledger import Ledger, Running
from shared.catalog import ModelProfile
from shared.settings import NodeSettings


def running(tenant: str) -> Running:
    return Running("1-0", f"events:{tenant}", 1, tenant=tenant)


def test_slots_are_kept_for_newcomers_once_two_callers_were_served_here(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(ledger.time, "monotonic", lambda: now[0])
    book = Ledger(
        ModelProfile(id="m", source="x", slots=4), NodeSettings(newcomer_slots=2), "s", print
    )
    book.admit("a1", running("alice"))
    book.admit("a2", running("alice"))
    assert book.newcomer_slots == 0 and book.tenants() == {"alice"}
    book.admit("b1", running("bob"))
    assert book.newcomer_slots == 2 and book.tenants() == {"alice", "bob"}
    now[0] += ledger.TENANTS_SEEN_S / 2
    book.admit("a3", running("alice"))
    now[0] += ledger.TENANTS_SEEN_S / 2 + 1  # bob last seen more than TENANTS_SEEN_S ago
    assert book.newcomer_slots == 0
    tiny = Ledger(
        ModelProfile(id="t", source="x", slots=2), NodeSettings(newcomer_slots=5), "t", print
    )
    tiny.admit("a", running("alice"))
    tiny.admit("b", running("bob"))
    assert tiny.newcomer_slots == 1  # never every slot
