"""What every process of a job shares, below the controller and the workers: the control-plane protocol on the
TCPStore and its operation counts, the store gloo's rendezvous reads through, whether a process still reaches
the controller, the append-only event logs and files that survive a crash.

Nothing here imports the controller, the workers or a recovery technique.
"""
