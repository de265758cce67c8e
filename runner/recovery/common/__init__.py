"""Recovery code every technique shares: the worker's recovery loop after a generation change (``rejoin``) and
the hook protocols through which a technique takes part in the training step (``hooks``).

A technique package may import this one; this one imports no technique package.
"""
