"""A model replica's state on its node: the one place it changes, and only along these transitions.

| from \\ to   | loading            | ready          | poisoned            | sleeping       | unloading      | failed                  |
|-------------|--------------------|----------------|---------------------|----------------|----------------|-------------------------|
| downloading | files verified     |                |                     |                | unload / drain | pull failed             |
| loading     |                    | loaded, groups | —                   |                | unload / drain | load failed; overdue    |
| ready       |                    |                | device fault;       | idle past      | unload / drain |                         |
|             |                    |                | output process died | keep_alive     |                |                         |
| poisoned    |                    | reloaded       |                     |                | unload / drain | reload failed; overdue  |
| sleeping    | woken (a load)     |                |                     |                | unload / drain |                         |
| unloading   |                    |                |                     |                |                |                         |
| failed      |                    |                |                     |                | unload         |                         |

- A replica whose files are not on the node starts `downloading` (node_agent/weights/puller.py fetches
  them from a peer node or the hub, sizes and hashes checked); it loads only once they are all here.
  A pull is bounded by its transfers' own timeouts, not by `replica_stuck_s` (a 100 GB model may
  take longer than that and still be moving).
- `loading` → `ready` needs the engine built and the consumer groups made; if either fails the
  replica is `failed` (its own waiting jobs fail; placement backs off from this node).
- `poisoned` → `ready` is the reload: the old engine freed, a new one built, all while the
  heartbeat says `poisoned` with the fault that caused it; if freeing or loading fails, `failed`.
- `sleeping` keeps the engine built (on a CPU device, within the node's `sleep_mb`): nothing is read
  or stepped; a load wakes it through `loading`, which then builds nothing.
- A fault while `loading` or `unloading` fails the jobs it names and changes nothing: a second load
  never starts beside the first (`poisoned` is entered from `ready` only).
- `failed` and `unloading` are ends: the agent drops the replica (and a later load makes a new one).
- `loading` and `poisoned` may last at most `replica_stuck_s` (NodeSettings): past that the agent
  marks the replica `failed`, so heartbeats stop counting it as serving and the fleet places the
  model elsewhere; a load that finishes after that frees what it built."""

import time

from shared.lifecycle import ModelState

D, L, R, P, S, U, F = (
    ModelState.DOWNLOADING,
    ModelState.LOADING,
    ModelState.READY,
    ModelState.POISONED,
    ModelState.SLEEPING,
    ModelState.UNLOADING,
    ModelState.FAILED,
)
TRANSITIONS: dict[ModelState, frozenset[ModelState]] = {
    D: frozenset({L, U, F}),
    L: frozenset({R, U, F}),
    R: frozenset({P, S, U}),
    P: frozenset({R, U, F}),
    S: frozenset({L, U}),
    U: frozenset(),
    F: frozenset({U}),
}
UNSETTLED = (L, P)  # states a replica may hold only for a bounded time


class IllegalTransition(RuntimeError):
    pass


class Replica:
    def __init__(self, model: str, clock=time.monotonic, state: ModelState = L):
        """A new replica: `loading`, or `downloading` when its files must be fetched first."""
        self.model, self._clock = model, clock
        self.state, self.error = state, ""
        self.since = clock()

    def can(self, state: ModelState) -> bool:
        return state in TRANSITIONS[self.state]

    def to(self, state: ModelState, error: str = "") -> None:
        """Move to `state` (with why, for `failed` and `poisoned`); a move the table lacks raises."""
        if not self.can(state):
            raise IllegalTransition(f"{self.model}: {self.state} → {state} is not a transition")
        self.state, self.since = state, self._clock()
        if error or state in (R, L):
            self.error = error

    def age_s(self) -> float:
        """Seconds in the current state."""
        return self._clock() - self.since

    def overdue(self, limit_s: float) -> bool:
        """In `loading` or `poisoned` for longer than `limit_s`."""
        return self.state in UNSETTLED and self.age_s() > limit_s
