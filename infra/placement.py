"""Where a run's actors live: starting or joining Ray, launching the engine and trainer actors, stopping them.

The actors (``infra.actors``) are named inside a per-run Ray namespace;
``actor(name, namespace)`` is how a task reaches one.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import ray

from reflow.config.load import config_to_json
from reflow.config.schema import ReflowConfig
from reflow.infra.actors import EngineWorker, FlexWorker, TrainerWorker, in_bundle
from reflow.infra.signals import interrupt_on_signals
from reflow.policies.multiturn import ToolSettings

# glibc malloc in every worker: freed memory stays in the process (one arena, never trimmed; blocks up to
# 32 MiB, glibc's largest threshold, come from that heap instead of mmap). On a VM that hands freed guest
# memory back to its host (virtio-balloon free page reporting, as on the CPU machines here) touching it again
# costs 4 to 10 s per GiB: a trainer step after a two-second pause paid up to twice its compute in page faults.
RESIDENT_MALLOC = {"MALLOC_ARENA_MAX": "1", "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
                   "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}


# Object-store endpoints and credentials (delta-rs reads them from the environment, as boto3 and polars do).
STORAGE_ENV_PREFIXES = ("AWS_", "GOOGLE_", "AZURE_")


def worker_env(threads: int, eager: bool) -> dict[str, str]:
    """Environment of the engine and trainer actors: quiet logs, ``threads`` torch threads, ``RESIDENT_MALLOC``,
    and the driver's object-store settings (``STORAGE_ENV_PREFIXES``), which a cluster's other nodes lack.

    ``eager`` (``rollout.enforce_eager``): no torch.compile in the workers at all (``TORCHDYNAMO_DISABLE``).
    vLLM compiles a few small sampler functions even in eager mode (the rank count of its log-probs): on the
    CPU that was 2-3 s of every engine's start, and 15 s of the first run on a machine (inductor's cache
    empty, C++ compiled); run eagerly they cost nothing measurable. Neither reflow's trainer nor its
    transformers engine compiles anything.
    """
    storage = {key: value for key, value in os.environ.items() if key.startswith(STORAGE_ENV_PREFIXES)}
    compiled = {"TORCHDYNAMO_DISABLE": "1"} if eager else {}
    return {"OMP_NUM_THREADS": str(threads), "VLLM_LOGGING_LEVEL": "WARNING",
            "TOKENIZERS_PARALLELISM": "false", "VLLM_CONFIGURE_LOGGING": "1",
            "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1", **compiled, **RESIDENT_MALLOC, **storage}


@dataclass(frozen=True)
class Placement:
    """Names of a run's actors inside its Ray namespace."""

    namespace: str
    engines: tuple[str, ...]
    trainer: str
    nodes: dict[str, str] = field(default_factory=dict)  # actor name -> Ray node id it runs on
    weight_bytes: int = 0  # one full copy of the weights (what a sync moves)


# Named actors that are not detached die with their last handle; the process
# that launched them keeps the handles here until ``stop_workers``.
_HANDLES: dict[str, list[Any]] = {}


class _DefaultTokenAuthNotice(logging.Filter):
    """Drops the warning a new local Ray prints on every start when it turns on token authentication, its
    default (the token is ``~/.ray/auth_token``): it is the first line of every run's output and asks nothing of
    the user. The opposite notice, a cluster without authentication, still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


_QUIET_TOKEN_NOTICE = _DefaultTokenAuthNotice()


def quiet_token_auth_notice() -> None:
    """Before ``ray.init``: leave out Ray's notice that it turned on token authentication (see the filter)."""
    logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(_QUIET_TOKEN_NOTICE)


def start_ray(cfg: ReflowConfig, namespace: str, verbose: bool = False) -> None:
    """Join ``resources.ray_address`` (or ``RAY_ADDRESS``), or start a quiet local Ray of the run's own.

    ``ray.init()`` without an address joins the cluster a ``ray start`` on
    this machine last started; reflow asks for ``"local"`` instead, so an
    unset address means a Ray of the run's own, as documented, whatever
    else runs here.
    """
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    quiet_token_auth_notice()
    kwargs: dict[str, Any] = {"namespace": namespace, "log_to_driver": verbose,
                              "configure_logging": True, "logging_level": "warning"}
    address = cfg.resources.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(address="local", num_cpus=cfg.resources.num_cpus, include_dashboard=False,
                 _system_config={"num_workers_soft_limit": worker_soft_limit(cfg)}, **kwargs)
    interrupt_on_signals()  # Ray replaced the handler


# Worker processes kept for Ray tasks (a snapshot's write, the deferred evaluation's reads, tool calls, code
# tests) beside the actors' own.
TASK_WORKERS = 2


def worker_soft_limit(cfg: ReflowConfig) -> int:
    """How many worker processes a local Ray keeps before it kills idle ones: the run's actors and
    ``TASK_WORKERS``.

    Ray's default is the node's CPU count, and every actor's process counts: with the CPUs all reserved by the
    engines and the trainer, the worker a task ran in was killed a second after it finished and the next task
    started a new one, which imports reflow and torch again (about 7 CPU-seconds on the 2-core machine; with
    an evaluation every step, steps took 4.0 s instead of 2.5 s; docs/measurements.md, 2026-12-06).
    """
    res = cfg.resources
    return max(res.num_cpus or os.cpu_count() or 1, res.engines + res.flex_workers + res.trainer_ranks + TASK_WORKERS)


def launch_workers(cfg: ReflowConfig, namespace: str, model_dir: str, store_root: str,
                   engine_settings: Any, version: int = 0, run_dir: str | None = None,
                   run_id: str | None = None, tool_fn: Any = None) -> Placement:
    """Create the engine actors (``resources.engines``, then the flex workers of ``resources.flex_workers``) and
    the trainer (``resources.trainer_ranks``); wait for all.

    Several engines take one placement group (spread over the nodes by
    default), several trainer ranks another (packed by default).

    All are restarted by Ray up to ``resources.max_actor_restarts`` times if
    their process dies, and the calls in flight are re-issued (see the
    classes for how each restores its state). With ``cfg.tools.max_calls > 0``
    the engine runs multi-turn tool use and ``tool_fn`` (transcript,
    timeout_s, max_chars) -> appended text is its tool.
    """
    t = cfg.tools
    tools = None
    if t.max_calls:
        if tool_fn is None:
            raise ValueError("tools.max_calls > 0 but no tool function was given to launch_workers")
        tools = ToolSettings(max_calls=t.max_calls, max_output_chars=t.max_output_chars, timeout_s=t.timeout_s,
                             cpus_per_call=t.cpus_per_call, max_concurrent_calls=t.max_concurrent_calls)

    res = cfg.resources
    check_capacity(cfg)
    env = {"env_vars": worker_env(res.torch_threads, cfg.rollout.enforce_eager)}
    restarts = {"max_restarts": res.max_actor_restarts, "max_task_retries": -1 if res.max_actor_restarts else 0}
    trainer_name = "trainer"
    engine_names = tuple(f"engine-{i}" for i in range(res.engines))
    spread = engine_placement_group(cfg)
    engines = [ray.remote(EngineWorker).options(
        name=name, namespace=namespace, num_cpus=res.engine_cpus, num_gpus=res.engine_gpus, runtime_env=env,
        max_concurrency=1, scheduling_strategy=in_bundle(spread, i), **restarts).remote(
            cfg.rollout.engine, engine_settings, version, trainer_name, tools, tool_fn)
        for i, name in enumerate(engine_names)]
    flex_names = tuple(f"flex-{i}" for i in range(res.flex_workers))
    # on a GPU the engine shares it with the worker's trainer module, and sleeps while the worker trains
    flex_settings = replace(engine_settings, sleep_mode=True,
                            gpu_memory_utilization=cfg.pool.gpu_memory_utilization)
    engines += [ray.remote(FlexWorker).options(
        name=name, namespace=namespace, num_cpus=res.flex_cpus, num_gpus=res.engine_gpus, runtime_env=env,
        max_concurrency=1, **restarts).remote(
            cfg.rollout.engine, flex_settings, model_dir, config_to_json(cfg), version, trainer_name, tools,
            tool_fn) for name in flex_names]
    engine_names += flex_names
    group = trainer_placement_group(cfg)
    if group is not None:  # a process group cannot take a restarted member: a dead rank fails the run
        restarts = {"max_restarts": 0, "max_task_retries": 0}
    # "read": ``prefetch`` runs beside ``train``; "sync": ``broadcast_weights`` too (every other method runs one at
    # a time, in call order)
    trainer = ray.remote(concurrency_groups={"read": 1, "sync": 1})(TrainerWorker).options(
        name=trainer_name, namespace=namespace, num_cpus=res.trainer_cpus, num_gpus=res.trainer_gpus,
        runtime_env=env, scheduling_strategy=in_bundle(group, 0), **restarts).remote(
            model_dir, config_to_json(cfg), store_root, res.torch_threads, run_dir, run_id, group)
    _HANDLES[namespace] = [*engines, trainer]
    ray.get([*(e.version.remote() for e in engines), trainer.version.remote()])
    if res.weight_sync == "broadcast":
        join_weight_group(cfg, trainer, engines)
    nodes = dict(zip(engine_names, ray.get([e.__ray_call__.remote(_node_id) for e in engines])))
    for rank, (_, node) in enumerate(ray.get(trainer.ranks.remote())):
        nodes[trainer_name if rank == 0 else f"{trainer_name}-rank-{rank}"] = node
    return Placement(namespace=namespace, engines=engine_names, trainer=trainer_name, nodes=nodes,
                     weight_bytes=ray.get(trainer.weight_bytes.remote()))


def check_capacity(cfg: ReflowConfig) -> None:
    """Fail with the numbers when the cluster has fewer CPUs or GPUs than the run's actors reserve (Ray would wait
    for them for ever)."""
    res = cfg.resources
    wanted = {"CPU": res.engines * res.engine_cpus + res.flex_workers * res.flex_cpus
                     + res.trainer_ranks * res.trainer_cpus,
              "GPU": (res.engines + res.flex_workers) * res.engine_gpus + res.trainer_ranks * res.trainer_gpus}
    have = ray.cluster_resources()
    for kind, need in wanted.items():
        if need > have.get(kind, 0.0) + 1e-9:
            raise RuntimeError(
                f"the run's actors reserve {need:g} {kind}s "
                f"(engines {res.engines} x {res.engine_cpus if kind == 'CPU' else res.engine_gpus:g}, "
                f"flex_workers {res.flex_workers} x {res.flex_cpus if kind == 'CPU' else res.engine_gpus:g}, "
                f"trainer_ranks {res.trainer_ranks} x {res.trainer_cpus if kind == 'CPU' else res.trainer_gpus:g}) "
                f"and the Ray cluster has {have.get(kind, 0.0):g}: lower resources.*_{kind.lower()}s or add "
                f"resources (resources.num_cpus for a local Ray)")


def join_weight_group(cfg: ReflowConfig, trainer: Any, engines: Sequence[Any]) -> None:
    """Form the weight broadcast group: the trainer's rank 0 serves it as rank 0, engine ``i`` is rank ``1 + i``.

    NCCL when the engines and the trainer all hold GPUs, else gloo (CPU tensors). Every member joins at once (the
    group's store waits for all of them).
    """
    res = cfg.resources
    backend = "nccl" if res.engine_gpus > 0 and res.trainer_gpus > 0 else "gloo"
    address, specs = ray.get([trainer.weight_group_address.remote(), trainer.weight_specs.remote()])
    world = 1 + len(engines)
    ray.get([trainer.join_weight_group.remote(address, world, backend),
             *(e.join_weight_group.remote(address, 1 + i, world, backend, specs) for i, e in enumerate(engines))])


def engine_placement_group(cfg: ReflowConfig) -> Any:
    """The placement group of the engines (one bundle each, ``resources.engine_placement``), ready; None for one."""
    res = cfg.resources
    if res.engines == 1:
        return None
    bundle = {"CPU": res.engine_cpus, **({"GPU": res.engine_gpus} if res.engine_gpus else {})}
    return _ready(ray.util.placement_group([bundle] * res.engines, strategy=res.engine_placement.upper()),
                  f"{res.engines} engines of {bundle} each ({res.engine_placement})")


def _ready(group: Any, what: str) -> Any:
    """``group`` once the cluster has reserved it; a plain error naming ``what`` if it cannot within 2 minutes."""
    if not group.wait(timeout_seconds=120):
        ray.util.remove_placement_group(group)
        raise RuntimeError(f"the cluster cannot place {what} within 2 minutes; its resources: "
                           f"{ray.cluster_resources()}")
    return group


def trainer_placement_group(cfg: ReflowConfig) -> Any:
    """The placement group of a sharded trainer's ranks (one bundle each), ready; None for one rank.

    ``resources.trainer_placement``: ``pack`` puts the ranks on as few nodes
    as hold them (the collectives stay inside a node where they can),
    ``spread`` one per node where there are enough.
    """
    res = cfg.resources
    if res.trainer_ranks == 1:
        return None
    bundle = {"CPU": res.trainer_cpus, **({"GPU": res.trainer_gpus} if res.trainer_gpus else {})}
    return _ready(ray.util.placement_group([bundle] * res.trainer_ranks, strategy=res.trainer_placement.upper()),
                  f"{res.trainer_ranks} trainer ranks of {bundle} each ({res.trainer_placement})")


def _node_id(actor_self: Any) -> str:
    """The Ray node an actor runs on (called inside the actor)."""
    return ray.get_runtime_context().get_node_id()


def actor(name: str, namespace: str) -> Any:
    """A run's actor by name."""
    return ray.get_actor(name, namespace=namespace)


def stop_workers(placement: Placement) -> None:
    """Kill the run's actors (their processes exit) and disconnect from Ray.

    Without a connection there are no actors of this process to kill: ``ray.get_actor`` would start a new local
    Ray for nothing (a resume stopped during its start-up took 7 s more, and left two of its agents running).
    ``ray.shutdown`` still stops what a ``ray.init`` that was interrupted had started.
    """
    if ray.is_initialized():
        for name in (*placement.engines, placement.trainer):
            try:
                ray.kill(ray.get_actor(name, namespace=placement.namespace))
            except ValueError:
                pass
    _HANDLES.pop(placement.namespace, None)
    ray.shutdown()
