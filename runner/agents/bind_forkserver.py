"""Imported first by a node agent's fork server, and nowhere else: the fork server dies with its agent, and
every process it forks dies with the fork server (``runner.agents.spawned``)."""

from runner.agents.spawned import bind_forked_children, die_with_parent

die_with_parent()
bind_forked_children()
