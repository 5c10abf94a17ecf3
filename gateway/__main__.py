"""`python -m gateway`: serve the gateway with settings from the environment (`CORTEX_…`)."""

from gateway.http.server import run
from shared.settings import GatewaySettings

if __name__ == "__main__":
    run(GatewaySettings())
