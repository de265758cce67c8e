"""Cluster-scale discrete-event simulator of the runner's recovery techniques.

Answers "what ETTR and RTO would each fault-tolerance mix give at N GPUs?" from
published failure rates, component costs from published measurements (a
profile per published cluster) and the runner's own decision function; the CLI
lives in `runner.sim.cli` (`python -m runner.sim`), the model in the sibling
modules.
"""
