from node_agent.agent import run

run()
