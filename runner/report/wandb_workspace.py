"""``python -m runner.report.wandb_workspace --entity E --project P``: build and save the project's W&B workspace.

Sections "Recovery" (recovery/rto_s and its phases), "Throughput" (train/tokens_per_s,
train/step_time_s, and the step reached against wall time) and "Loss" (train/loss), with runs grouped
by their W&B group, which the runner sets to the sweep directory relative to the working directory
(runner/report/loggers.py). Every panel is drawn against the axes the runner's W&B run defines
(runner/control/run_logger.py): ``global_step``, the training step of a row (a recovery's row sits
at the step its recovered world committed first), and ``wall_time``, seconds since the job started.
Needs the optional ``wandb-workspaces`` package (``pip install "resilient-runner[workspace]"``) and a
logged-in, online W&B; otherwise it explains what is missing and exits 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from runner.report.collect import PHASES
from runner.report.loggers import STEP_AXIS, TIME_AXIS

EXIT_UNAVAILABLE = 2
RECOVERY_KEYS = ["recovery/rto_s", *(f"recovery/{p}" for p in PHASES)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.report.wandb_workspace", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entity", required=True, help="W&B user or team")
    parser.add_argument("--project", required=True, help="W&B project the runs were synced to (logger.project)")
    parser.add_argument("--name", default="resilient-runner", help="workspace name (default: %(default)s)")
    args = parser.parse_args(argv)
    problem = _offline_reason()
    if problem is None:
        try:
            import wandb_workspaces.reports.v2 as wr
            import wandb_workspaces.workspaces as ws
        except ImportError:
            problem = ("the wandb-workspaces package is not installed; install it with "
                       "`pip install \"resilient-runner[workspace]\"` (or `pip install wandb-workspaces`) and run this "
                       "again")
    if problem is not None:
        print(f"[runner.report] Cannot build the W&B workspace: {problem}. Nothing was saved; the offline "
              "runs under each run directory's wandb/ can be uploaded with `wandb sync` first.", file=sys.stderr)
        return EXIT_UNAVAILABLE
    workspace = build(ws, wr, args.entity, args.project, args.name)
    workspace.save()
    print(f"[runner.report] saved workspace {args.name!r}: {workspace.url}")
    return 0


def build(ws, wr, entity: str, project: str, name: str):
    """The workspace object: three open sections, runs grouped by W&B group (= sweep dir)."""
    sections = [
        ws.Section(name="Recovery", is_open=True, panels=[
            wr.BarPlot(title="RTO per run (s)", metrics=["recovery/rto_s"], orientation="h"),
            wr.BarPlot(title="RTO phases per run (s)", metrics=RECOVERY_KEYS[1:], orientation="h"),
            wr.LinePlot(title="RTO and phases per recovery, at the step training resumed (s)", x=STEP_AXIS,
                        y=RECOVERY_KEYS),
        ]),
        ws.Section(name="Throughput", is_open=True, panels=[
            wr.LinePlot(title="tokens/s", x=STEP_AXIS, y=["train/tokens_per_s"], title_y="tokens/s"),
            wr.LinePlot(title="step time (s)", x=STEP_AXIS, y=["train/step_time_s"], title_y="s"),
            wr.LinePlot(title="progress (recoveries are flats)", x=TIME_AXIS, y=[STEP_AXIS], title_x="wall time (s)",
                        title_y="step"),
        ]),
        ws.Section(name="Loss", is_open=True, panels=[
            wr.LinePlot(title="training loss", x=STEP_AXIS, y=["train/loss"], title_y="loss"),
        ]),
    ]
    return ws.Workspace(entity=entity, project=project, name=name, sections=sections,
                        runset_settings=ws.RunsetSettings(groupby=[ws.Metric("Group")]))


def _offline_reason() -> str | None:
    """Why W&B cannot be reached from here, or None if it looks usable."""
    mode = os.environ.get("WANDB_MODE", "")
    if mode in {"offline", "disabled", "dryrun"}:
        return f"WANDB_MODE={mode} (unset it, or set WANDB_MODE=online)"
    import wandb

    if not wandb.login(prompt=False, verify=False):
        return "not logged in to W&B (run `wandb login` or set WANDB_API_KEY)"
    return None


if __name__ == "__main__":
    sys.exit(main())
