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
    """``ray.init()`` alone would join the cluster last started on this machine (here one with no CPU). Neither
    start prints Ray's notice that it turned on token authentication, its default (the first line of every run's
    output before)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
        proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "Token authentication is enabled" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
        address, cpus = proc.stdout.split()[-2:]
        assert address != cluster.address and float(cpus) == 1.0, (address, cluster.address, cpus)
        joined = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300,
                                env={**env, "RAY_ADDRESS": cluster.address})  # RAY_ADDRESS still joins
        assert joined.returncode == 0, joined.stderr[-3000:]
        assert "Token authentication is enabled" not in joined.stdout + joined.stderr, joined.stderr[-3000:]
        assert joined.stdout.split()[-2] == cluster.address
    finally:
        cluster.shutdown()


TASKS = """
import os, time
import ray
from reflow.config.schema import ReflowConfig
from reflow.infra.placement import start_ray
start_ray(ReflowConfig.model_validate({"resources": {"num_cpus": 2}}), "probe")

@ray.remote(num_cpus=1)
class Busy:  # an engine and a trainer: every CPU reserved by an actor
    def pid(self):
        return os.getpid()

@ray.remote(num_cpus=0)
def task():  # as a snapshot's write: a task beside the actors
    return os.getpid()

actors = [Busy.remote(), Busy.remote()]
ray.get([a.pid.remote() for a in actors])
pids = []
for _ in range(3):
    pids.append(ray.get(task.remote()))
    time.sleep(3)  # Ray kills a worker idle for a second beyond its soft limit
print(*pids)
ray.shutdown()
"""


@pytest.mark.slow
def test_a_task_beside_actors_that_hold_every_cpu_reuses_its_worker_process() -> None:
    """With Ray's default soft limit (the CPU count, the actors included), each task started a new worker that
    imported everything again: 7 CPU-seconds per evaluation snapshot on two cores."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", TASKS], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pids = proc.stdout.split()[-3:]
    assert len(set(pids)) == 1, f"each task ran in a new worker process: {pids}"
