import sys

if any(
    arg.startswith("--simulate") for arg in sys.argv[1:]
):  # many simulated nodes in this process (node_agent/sim/fleet.py)
    from node_agent.sim.fleet import main

    main(sys.argv[1:])
else:
    from node_agent import host_share

    host_share.before_torch()  # OpenMP reads its wait policy when torch loads it

    from node_agent.serving.agent import run  # imports torch

    run()
