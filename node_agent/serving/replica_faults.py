"""What goes wrong with a replica (node_agent/serving/served_model.py), and every move it makes to
`poisoned` or `failed` along the state table in replica.py: a failed engine step fails its jobs
only; a device fault, or the output process dying, poisons a `ready` replica (its jobs fail, it
stops reading and is reloaded once); a load that fails, or a replica `loading` or `poisoned` past
`replica_stuck_s`, is `failed`."""

import asyncio
import logging
from typing import TYPE_CHECKING

from shared.errors import GenerationFailed, ModelLoadFailed, ModelPoisoned
from shared.lifecycle import ModelState

if TYPE_CHECKING:
    from node_agent.serving.served_model import ServedModel

log = logging.getLogger(__name__)


class ReplicaFaults:
    def __init__(self, served: "ServedModel"):
        self.served = served

    def on_failure(self, exc: BaseException, jobs: list[str], device_fault: bool) -> None:
        """A step failed on the device thread (its jobs are out of the engine): a fault of the device
        poisons the model; anything else fails those jobs only."""
        if device_fault:
            self.poison(exc, jobs)
            return
        error = GenerationFailed(
            f"the engine step failed ({type(exc).__name__}: {exc}); the model is still served, "
            "try again"
        )
        for job in jobs:
            self.served.ledger.fail(job, error)

    def poison(self, exc: BaseException, jobs: list[str]) -> None:
        """A device error: fail this model's jobs with a 503 that says why; a `ready` replica stops
        reading and is reloaded (once: in any other state nothing more starts)."""
        served, error = self.served, f"{type(exc).__name__}: {exc}"
        if served.state == ModelState.READY:
            served.replica.to(ModelState.POISONED, error)
            log.error("%s is poisoned (%s); reloading it", served.profile.id, error)
            served.consumer.halt()  # the slots freed below must not wake the reader
            asyncio.get_running_loop().create_task(
                self._reload(), name=f"reload-{served.profile.id}"
            )
        served.ledger.fail_all(
            ModelPoisoned(
                f"{served.profile.id} failed on {served.consumer_name} "
                f"({', '.join(served.devices)}): {error}; it is being reloaded"
            ),
            jobs,
        )

    async def _reload(self) -> None:
        """`poisoned` → `ready` once the old engine is freed and a new one built; → `failed` when either fails."""
        served, error = self.served, self.served.replica.error
        await served.consumer.stop()
        served.ledger.fail_all(
            ModelPoisoned(
                f"{served.profile.id} failed on {served.consumer_name}: {error}; "
                "it is being reloaded"
            )
        )  # handed over by the last read
        try:
            await served.free()
        except Exception as exc:
            if served.replica.can(ModelState.FAILED):
                served.replica.to(
                    ModelState.FAILED, f"{error}; freeing it failed: {type(exc).__name__}: {exc}"
                )
            log.error("%s could not be freed after it was poisoned: %s", served.profile.id, exc)
            return
        if served.state == ModelState.POISONED:  # not unloaded or given up meanwhile
            await served.load()

    async def load_failed(self, exc: Exception) -> None:
        """Free what the load built; when this replica is now `failed`, fail the jobs routed to this
        node alone (the model's shared queue waits for the fleet's other replicas or placement)."""
        served, error = self.served, f"{type(exc).__name__}: {exc}"
        log.error("loading %s failed: %s", served.profile.id, error)
        failed = served.replica.can(ModelState.FAILED)
        if failed:
            served.replica.to(ModelState.FAILED, error)
        try:
            await served.free()
        except Exception as free_exc:
            log.error("%s: freeing a failed load failed too: %s", served.profile.id, free_exc)
        if failed:
            await served.consumer.fail_own_backlog(
                ModelLoadFailed(
                    f"loading {served.profile.id} on {served.consumer_name} failed: {error}"
                )
            )

    def give_up_if_overdue(self) -> bool:
        """`loading` or `poisoned` past `replica_stuck_s`: `failed`, so the fleet places the model elsewhere."""
        served, stuck_s = self.served, self.served.settings.replica_stuck_s
        if not served.replica.overdue(stuck_s):
            return False
        log.error(
            "%s has been %s for over %.0f s; giving it up", served.profile.id, served.state, stuck_s
        )
        served.replica.to(ModelState.FAILED, f"{served.state} for over {stuck_s:.0f} s")
        served.ledger.fail_all(
            ModelLoadFailed(
                f"{served.profile.id} on {served.consumer_name} was given up: "
                f"{served.replica.error}"
            )
        )
        return True
