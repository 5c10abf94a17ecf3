"""States every part reads the same way: a node's, a model replica's, a finished choice's."""

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
    POISONED = "poisoned"
    UNLOADING = "unloading"
    FAILED = "failed"


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"
