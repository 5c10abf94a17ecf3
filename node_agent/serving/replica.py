"""A model replica's state on its node: the one place it changes, and only along these transitions.

| from \\ to  | loading            | ready          | poisoned            | unloading      | failed                  |
|------------|--------------------|----------------|---------------------|----------------|-------------------------|
| loading    |                    | loaded, groups | —                   | unload / drain | load failed; overdue    |
| ready      |                    |                | device fault;       | unload / drain |                         |
|            |                    |                | output process died |                |                         |
| poisoned   |                    | reloaded       |                     | unload / drain | reload failed; overdue  |
| unloading  |                    |                |                     |                |                         |
| failed     |                    |                |                     | unload         |                         |

- `loading` → `ready` needs the engine built and the consumer groups made; if either fails the
  replica is `failed` (its own waiting jobs fail; placement backs off from this node).
- `poisoned` → `ready` is the reload: the old engine freed, a new one built, all while the
  heartbeat says `poisoned` with the fault that caused it; if freeing or loading fails, `failed`.
- A fault while `loading` or `unloading` fails the jobs it names and changes nothing: a second load
  never starts beside the first (`poisoned` is entered from `ready` only).
- `failed` and `unloading` are ends: the agent drops the replica (and a later load makes a new one).
- `loading` and `poisoned` may last at most `replica_stuck_s` (NodeSettings): past that the agent
  marks the replica `failed`, so heartbeats stop counting it as serving and the fleet places the
  model elsewhere; a load that finishes after that frees what it built."""

import time

from shared.lifecycle import ModelState

L, R, P, U, F = ModelState.LOADING, ModelState.READY, ModelState.POISONED, ModelState.UNLOADING, ModelState.FAILED
TRANSITIONS: dict[ModelState, frozenset[ModelState]] = {
    L: frozenset({R, U, F}),
    R: frozenset({P, U}),
    P: frozenset({R, U, F}),
    U: frozenset(),
    F: frozenset({U}),
}
UNSETTLED = (L, P)  # states a replica may hold only for a bounded time


class IllegalTransition(RuntimeError):
    pass


class Replica:
    def __init__(self, model: str, clock=time.monotonic):
        self.model, self._clock = model, clock
        self.state, self.error = L, ""
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
