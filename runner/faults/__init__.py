"""Fault injection: the faults that fault configs (``recipes/fault/``) and chaos runs inject.

Nothing here runs unless a fault config asks for it; production code paths do not depend on it.
"""
