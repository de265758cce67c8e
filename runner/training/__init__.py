"""One training process: the worker (``worker``), its Lightning strategy (``strategy``), its rebuildable
communicator (``comm``), the gradient reduction (``reducer``), ZeRO-1 (``zero``), and the training step apart
from Lightning's glue.

``commit``: the committed-step protocol (reduce, retry after a regroup, the corruption guard,
accounting); ``update``: the optimizer update of a committed step, applied exactly once; ``state``:
the typed view of a replica's state that recovery code uses; ``transfer``: that view, and the
exchange of state between replicas.
"""
