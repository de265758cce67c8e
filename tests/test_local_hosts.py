"""tests/local_hosts.py, the hosts on one machine of the torchrun tests and benches: a job finds every process it
started by its token and leaves none behind; what it reads of a run dir."""

from __future__ import annotations

import json
import sys

from tests.local_hosts import Job, c10d_rendezvous, events, max_step, processes_of, wait_for


def test_a_jobs_processes_carry_its_token_and_end_with_it(tmp_path):
    job = Job(tmp_path / "run")
    proc = job.start([sys.executable, "-c", "import time; time.sleep(120)"])
    # read from /proc the moment Popen returned, the child's environment once lacked the token (CI, a loaded 2-core
    # host): it is the started process's, so wait for it there, bounded
    wait_for("the token in the started process's environment", lambda: proc.pid in processes_of(job.token),
             timeout_s=30, procs=[proc])
    assert not processes_of("another job")
    job.close()
    assert proc.poll() is not None and not processes_of(job.token)


def test_what_a_job_reads_of_its_run_dir(tmp_path):
    assert events(tmp_path, "host_joined") == [] and max_step(tmp_path) == -1  # nothing written yet
    lines = [{"kind": "host_joined", "node": 1}, {"kind": "run_start"}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 2, 1)))
    assert events(tmp_path, "host_joined") == [lines[0]] and max_step(tmp_path) == 2
    backend, endpoint, rdzv_id = c10d_rendezvous()
    assert backend == "--rdzv-backend=c10d" and endpoint.startswith("--rdzv-endpoint=127.0.0.1:") and rdzv_id
