from node_agent import host_share

host_share.before_torch()  # OpenMP reads its wait policy when torch loads it

from node_agent.serving.agent import run  # noqa: E402 (imports torch)

run()
