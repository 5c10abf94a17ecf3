"""The job lifecycle, one enum for every part."""

from enum import StrEnum


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


class ModelState(StrEnum):
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
