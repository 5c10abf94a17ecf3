"""A simulated replica: the real `ServedModel` (consumer, ledger, intake, faults, output) whose
engine the simulated device builds (node_agent/sim/device.py) and whose output side runs in the
node's process (node_agent/sim/output.py)."""

from collections.abc import Awaitable

from node_agent.engine.engine import Engine
from node_agent.serving.served_model import ServedModel
from node_agent.sim.output import LocalLink
from shared.catalog import ModelProfile
from shared.settings import NodeSettings


class SimServedModel(ServedModel):
    def engine_start(
        self, profile: ModelProfile, device_ids: list[str], settings: NodeSettings, node: str
    ) -> Awaitable[Engine]:
        return self.device.open_engine(profile, node)

    def output_link(self, config: dict, on_feedback, on_exit) -> LocalLink:
        return LocalLink(config, on_feedback, on_exit, self.reader.redis)
