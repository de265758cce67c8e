"""``python -m runner.agents``: run one host's node agent (see runner.agents.node_agent)."""

from runner.agents.node_agent import main

main()
