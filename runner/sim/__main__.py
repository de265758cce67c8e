"""`python -m runner.sim [overrides]`: see docs/simulator.md."""
from runner.sim.cli import main

main()
