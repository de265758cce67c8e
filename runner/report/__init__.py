"""``python -m runner.report DIR``: a Markdown table and PNG plots comparing the runs of a sweep.

``collect`` reads the jobs, ``table`` writes report.md, ``plots`` draws the PNGs, and
``wandb_workspace`` builds the matching W&B workspace.
"""
