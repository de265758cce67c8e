"""The controller and its parts: membership and generations, detection, incidents, carrying out decisions.

``Controller`` (``controller.py``) runs the loop and wires the parts; the recovery techniques' actions
come from ``runner/recovery/registry.py`` and fault injection from ``runner/faults/``.
"""
