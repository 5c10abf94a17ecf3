import sys

if any(
    arg.startswith("--simulate") for arg in sys.argv[1:]
):  # many simulated nodes in this process (node_agent/sim/fleet.py)
    from node_agent.sim.fleet import main

    main(sys.argv[1:])
else:
    from node_agent.serving.agent import run

    run()
