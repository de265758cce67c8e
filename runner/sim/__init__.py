"""Cluster-scale discrete-event simulator of recovery strategies.

Answers "what ETTR and RTO would each fault-tolerance mix give at N GPUs?" from
published failure rates and a component model of each recovery; the CLI lives
in `runner.sim.cli` (`python -m runner.sim`), the model in the sibling modules.
"""
