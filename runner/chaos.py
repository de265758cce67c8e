"""Compatibility import path for the worker-side fault hooks: chaos now lives in ``runner.faults.chaos``."""

from runner.faults.chaos import ORDER_KEY, SIGNAL, WORKER_SIDE, Chaos, Draw

__all__ = ["ORDER_KEY", "SIGNAL", "WORKER_SIDE", "Chaos", "Draw"]
