"""`python -m gateway.batch`: the batch worker with settings from the environment (`CORTEX_…`)."""

from gateway.batch.worker import run
from shared.settings import BatchSettings

if __name__ == "__main__":
    run(BatchSettings())
