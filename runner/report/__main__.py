"""``python -m runner.report DIR``: write report.md, progress.png, rto_phases.png, throughput.png and loss.png
into DIR."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runner.report.collect import find_jobs

EXIT_NO_JOBS = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.report", description=__doc__)
    parser.add_argument("dir", type=Path, help="a Hydra multirun sweep dir (multirun/<date>/<time>) or any "
                                               "directory holding run dirs")
    root = parser.parse_args(argv).dir
    jobs = find_jobs(root) if root.is_dir() else []
    if not any(j.summary for j in jobs):
        print(f"[runner.report] No job with a summary.json under {root}: pass a sweep directory "
              "(multirun/<date>/<time>, whose job subdirectories 0, 1, ... each hold the summary.json that "
              "python -m runner writes when a run ends) or a directory of run directories. A run that stopped "
              "at a configuration error or only printed its plan writes no summary.json.", file=sys.stderr)
        return EXIT_NO_JOBS
    from runner.report import plots, table  # matplotlib only once there is something to draw

    names = plots.draw_all(jobs, root)
    (root / "report.md").write_text(table.render(jobs, root, names))
    print(f"[runner.report] {len(jobs)} jobs -> {root / 'report.md'}, " + ", ".join(names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
