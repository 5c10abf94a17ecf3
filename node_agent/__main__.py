from node_agent.serving.agent import run

run()
