"""A simulated node: the real node agent (node_agent/serving: heartbeat, command and cancel
listeners, consumer, ledger, intake, output side, publisher) with a synthetic engine, many nodes to
a process (`python -m node_agent --simulate N`, node_agent/sim/fleet.py).

Only what touches a device differs: the engine is the real `Engine` (scheduler, KV block pool and
prefix cache, prefix marks, output records) over a runner that samples without a model
(runner.py), stepped on the event loop at a set step time (device.py); its output side runs in the
node's own process instead of a process of its own (output.py); the tokenizer is a byte-level one
(tokenizer.py). So the simulation cannot drift from what real nodes say to Redis."""
