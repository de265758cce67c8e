"""What a layout is, from the config alone, before anything runs: the Topology (who runs where, who backs up
whom), the plan (parameters, batch, memory and compute per rank) and the model's size and cost.

Pure functions of the config: no process, store or device.
"""
