"""Where a run's Ray comes from."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD = """
import ray
from reflow.config.schema import ReflowConfig
from reflow.infra.placement import start_ray
start_ray(ReflowConfig.model_validate({"resources": {"num_cpus": 1}}), "probe")
print(ray.get_runtime_context().gcs_address, ray.cluster_resources().get("CPU"))
ray.shutdown()
"""


@pytest.mark.slow
def test_an_unset_ray_address_starts_a_ray_of_the_run_s_own_beside_a_running_cluster() -> None:
    """``ray.init()`` alone would join the cluster last started on this machine (here one with no CPU)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        address, cpus = proc.stdout.split()[-2:]
        assert address != cluster.address and float(cpus) == 1.0, (address, cluster.address, cpus)
        joined = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300,
                                env={**env, "RAY_ADDRESS": cluster.address})  # RAY_ADDRESS still joins
        assert joined.returncode == 0, joined.stderr[-3000:]
        assert joined.stdout.split()[-2] == cluster.address
    finally:
        cluster.shutdown()
