"""One lossy-link lab job with every agent in the agent image, as the chart's DaemonSet runs it
(its capabilities as far as docker names them, its host mounts, a read-only root:
ingero_operator.demo.container_argv), and the operator in the operator image as its non-root
user, through a whole session: the straggler rank, its node and the network cause, as the
same job gets without containers (tests/cluster/verdict.py)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.cluster import verdict
from tests.conftest import background_load

pytestmark = pytest.mark.bpf


def test_the_agent_image_traces_a_lab_job_and_the_operator_image_completes_its_session(images, tmp_path):
    from ingero_operator.demo import Demo, DemoConfig

    # bcc compiles the probes in each agent's container; beside CI's load that took 72-89 s where
    # the host's agents took 40-77 s in the same hour
    cfg = DemoConfig(scenario="lossy-link", seconds=10.0, out=tmp_path, images=images,
                     background_load=background_load(), attach_timeout_s=180.0)
    with Demo(cfg, log=lambda _m: None) as demo:
        res = demo.run()
        # the components really ran from the images
        running = subprocess.run(["docker", "ps", "--format", "{{.Names}} {{.Image}}"], capture_output=True,
                                 text=True, check=True).stdout.split("\n")
        ours = sorted(ln for ln in running if ln.startswith(f"ingero-demo-{demo.lab.run_id}-"))
    print(f"containers: {ours}; timings {json.dumps(res.timings)}")
    assert [ln.split()[1] for ln in ours] == [images["agent"]] * 2 + [images["operator"]], ours
    s = verdict.check_straggler(res.status, 4, res.lab["victim_rank"], res.lab["victim_node"], "network")
    assert "retransmits" in s["evidence"]
    # written by the operator's user in its container
    assert os.stat(res.status["artifact"]["path"]).st_uid == 65532
