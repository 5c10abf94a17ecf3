"""States every part reads the same way: a node's, a model replica's, a finished choice's, a job's."""

from enum import StrEnum


class NodeState(StrEnum):
    ACTIVE = "active"  # takes new jobs
    DRAINING = "draining"  # takes none; finishes its running ones, then unloads
    DRAINED = "drained"  # idle, holding nothing, until it is restarted

    @property
    def takes_jobs(self) -> bool:
        return self is NodeState.ACTIVE


class ModelState(StrEnum):
    DOWNLOADING = "downloading"  # fetching its files (from a peer node or the hub) before loading
    LOADING = "loading"
    READY = "ready"
    # idle past its keep_alive on a CPU node with `sleep_mb`: not serving, but its engine (weights,
    # compiled step, cached prefixes) kept in memory so that a load wakes it in a fraction of a load
    SLEEPING = "sleeping"
    POISONED = "poisoned"
    UNLOADING = "unloading"
    FAILED = "failed"


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


class JobState(StrEnum):
    """A job's life as the gateway that submitted it sees it (gateway/jobs/job.py). It is queued
    from its submission until the first event of a node; it ends once, in `Job.close` or
    `Job.detach`: finished or failed as the node ended it (or failed still queued, past its queue
    deadline: gateway/jobs/queue.py), cancelled (withdrawn from its stream, or
    stopped where it ran) when nobody waits for it any more, detached when it runs on without its
    client."""

    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"
    DETACHED = "detached"

    @property
    def ended(self) -> bool:
        return self not in (JobState.QUEUED, JobState.RUNNING)

    def may_become(self, state: "JobState") -> bool:
        return state in _JOB_MOVES[self]


_JOB_MOVES = {
    JobState.QUEUED: {JobState.RUNNING, JobState.FAILED, JobState.CANCELLED, JobState.DETACHED},
    JobState.RUNNING: {JobState.FINISHED, JobState.FAILED, JobState.CANCELLED, JobState.DETACHED},
    **{
        ended: set()
        for ended in (JobState.FINISHED, JobState.FAILED, JobState.CANCELLED, JobState.DETACHED)
    },
}
