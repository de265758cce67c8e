"""Node agents: one process per host that starts, signals and watches that host's workers for the controller.

``node_agent`` is the process (``python -m runner.agents``), ``fleet`` the controller's side of all of them,
``auth`` the per-job secret that signs every command, ``spawned`` what runs in the processes an agent forks.
"""
