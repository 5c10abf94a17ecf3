"""`python -m node_agent --simulate N`: N simulated nodes in one asyncio process, each the real
`NodeAgent` (its own name, Redis client, heartbeat, command and cancel listeners, consumers and
publishers) on a simulated device (node_agent/sim/device.py). Settings come from the environment
as a node's do (`CORTEX_REDIS_URL`, `CORTEX_MODELS_FILE`, ...); the hardware from the flags below.
Node i is named `{prefix}-{i}`; `--preload` spreads models over the nodes at start (model j on node
j mod the fleet's size: fewer models than nodes leaves some nodes empty for placement to fill). Starts are spread
over one heartbeat interval, as a real fleet's are. SIGTERM or SIGINT stops every node cleanly.

    python -m node_agent --simulate 100 --step-ms 20 --preload m-0,m-1,m-2
"""

import argparse
import asyncio
import logging
import signal

from node_agent.serving.agent import NodeAgent
from node_agent.sim.config import SimConfig
from node_agent.sim.device import SimDevice
from node_agent.sim.served import SimServedModel
from shared.catalog import ModelProfile
from shared.settings import NodeSettings

log = logging.getLogger(__name__)


class SimNodeAgent(NodeAgent):
    def __init__(self, settings: NodeSettings, config: SimConfig):
        super().__init__(settings)
        self.sim = config

    def start_devices(self, loop: asyncio.AbstractEventLoop) -> list[SimDevice]:
        device = SimDevice(self.sim, loop)
        device.start()
        return [device]

    def served_class(self, profile: ModelProfile) -> type[SimServedModel]:
        return SimServedModel

    async def _share_cores(self) -> None:
        """A simulated node has no cores to share: the many in one process are not agents of this
        host (node_agent/host_share.py), and their devices run no torch threads."""


def fleet_settings(
    base: NodeSettings, config: SimConfig, names: dict[int, str], total: int, preload: list[str]
) -> list[NodeSettings]:
    """Each node's settings: its name, its share of `preload` (model j on node number j mod
    `total`, the whole fleet's size), the device's memory as its budget."""
    return [
        base.model_copy(
            update=dict(
                node_name=name, models=preload[number::total], memory_budget_mb=config.memory_mb
            )
        )
        for number, name in names.items()
    ]


async def run_fleet(agents: list[NodeAgent], spread_s: float) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: [agent.stop() for agent in agents])

    async def serve(i: int, agent: NodeAgent) -> None:
        await asyncio.sleep(spread_s * i / len(agents))
        await agent.serve()

    await asyncio.gather(*(serve(i, agent) for i, agent in enumerate(agents)))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m node_agent", description=__doc__)
    p.add_argument("--simulate", type=int, required=True, metavar="N", help="simulated nodes")
    p.add_argument("--first", type=int, default=0, help="the first node's number (default 0)")
    p.add_argument("--prefix", default="sim", help="node names: PREFIX-i (default sim)")
    p.add_argument("--preload", default="", help="comma-separated models spread over the nodes")
    p.add_argument(
        "--fleet-size",
        type=int,
        default=0,
        help="nodes in the whole fleet, over every process (default: FIRST + N): model j of "
        "--preload goes to node number j mod this",
    )
    for name, field in SimConfig.model_fields.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=field.annotation, default=field.default)
    return p.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    base = NodeSettings()
    logging.basicConfig(
        level=base.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = SimConfig(**{name: getattr(args, name) for name in SimConfig.model_fields})
    numbers = range(args.first, args.first + args.simulate)
    names = {n: f"{args.prefix}-{n}" for n in numbers}
    preload = [m for m in args.preload.split(",") if m]
    total = args.fleet_size or numbers.stop
    agents = [
        SimNodeAgent(settings, config)
        for settings in fleet_settings(base, config, names, total, preload)
    ]
    log.info("simulating %d nodes from %s: %s", len(agents), names[numbers[0]], config)
    asyncio.run(run_fleet(agents, base.heartbeat_s))
