"""The health check's network path to the peers (``runner.training.health.check_peers``) under launcher.mode=per_host:
three torchrun trees as three hosts, each in a network namespace of its own (tests/test_netns_host_loss.py's), and the
spare host without a route to host 1. Its spares reach the control-plane store and host 0's ranks, not host 1's: they
are refused naming the peers they cannot reach, and the job trains on exactly."""

from __future__ import annotations

import pytest

from tests import netns
from tests.test_health import assert_spares_refused
from tests.test_netns_host_loss import LAYOUT, start_hosts
from tests.test_torchrun_per_host import as_run, assert_trees_end, local_fault_free  # noqa: F401  (the fixture)


@pytest.mark.slow
@pytest.mark.skipif(netns.skip_reason() is not None, reason=str(netns.skip_reason()))
def test_a_spare_host_without_a_path_to_a_peer_host_is_refused_naming_it(make_job, local_fault_free):  # noqa: F811
    job = make_job()
    with netns.Hosts(3) as hosts:
        try:
            hosts.unreachable(2, 1)  # before host 2's tree starts: its spares check their peers at once
            start_hosts(job, hosts, *LAYOUT)
            run = as_run(job)
            assert run.returncode == 0, job.output()
            failed = assert_spares_refused(run, local_fault_free)
            peer = hosts.address(1)
            for e in failed:  # host 1's two ranks, each at its own listener on host 1's address; host 0's reached
                assert e["measured"]["peers"] == 4, e
                unreachable = [part for part in e["reason"].split("; ") if part.startswith("no TCP connection to peer")]
                assert [p.split(" on host")[0] for p in unreachable] == ["no TCP connection to peer rank 2",
                                                                         "no TCP connection to peer rank 3"], e
                assert all(f" at {peer}:" in p and "No route to host" in p for p in unreachable), e
            assert_trees_end(job)
        finally:
            job.close()
