"""``reflow run``, ``resume``, ``config`` and ``model init``: start, continue and inspect a training run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from reflow.cli.runtime import MIN_FREE_MIB, check_writable, prefect_api_starting, preflight, quiet_environment
from reflow.config.load import InputError, config_to_json, load_config, stored_config
from reflow.config.reference import reference_markdown
from reflow.config.schema import ReflowConfig
from reflow.infra.run import RunOutcome, find_finished_run, find_run, new_run_id, read_finished
from reflow.infra.runlock import describe_writers, live_writers


def cmd_resume(args: argparse.Namespace) -> int:
    run_dir = find_run(args.run, args.runs)
    try:
        cfg = stored_config((run_dir / "config.json").read_text(), str(run_dir / "config.json"))
    except ValueError as exc:
        raise InputError(f"{run_dir / 'config.json'}: unreadable: {exc}") from None
    record = run_dir / "run.json"
    try:
        # killed during start-up: no record yet, and the run id is the directory's name (``new_run_id``)
        data = json.loads(record.read_text()) if record.is_file() else {"run_id": run_dir.name}
    except ValueError as exc:
        raise InputError(f"{record}: unreadable: {exc}") from None
    run_id = data.get("run_id") if isinstance(data, dict) else None
    if not isinstance(run_id, str) or not run_id:
        raise InputError(f"{record}: not a reflow run record (expected an object with a run_id)")
    done = read_finished(run_dir)
    if done is not None:
        print(f"reflow resume {run_id}: the run finished at {done.finished_at} after {done.steps} steps; "
              "nothing to resume", flush=True)
        print_outcome(done)
        return 0
    writers = live_writers(run_dir, None)  # the run's own lock (other runs may share a store root)
    if writers:
        raise InputError(f"{run_dir} is still running; wait for it to finish, or stop it first (a lock that "
                         "names a process that is not this run can be deleted):\n" + describe_writers(writers))
    # the checks of a new run: the model, reward function and dataset it names may have gone since, and a
    # resumed run writes checkpoints, tables and MLflow records as a new one does
    preflight(cfg)
    check_writable(run_dir, "the run directory", MIN_FREE_MIB)
    quiet_environment(args.verbose)
    print(f"reflow resume {run_id}: mode={cfg.mode.kind} steps={cfg.run.total_steps}", flush=True)
    with prefect_api_starting():  # the flow imports (about 8 s) while the API server starts
        from reflow.flows.rl_train import rl_train

    outcome = rl_train(config=cfg, run_dir=str(run_dir), run_id=run_id, resume=True)
    print_outcome(outcome)
    return 0


def print_outcome(outcome: RunOutcome) -> None:
    print(f"\nrun directory : {outcome.run_dir}\ncurves        : {outcome.curves_png}\n"
          f"final model   : {outcome.final_model}\nDelta tables  : {outcome.store_root}/trajectories, "
          f"{outcome.store_root}/usage\nMLflow run    : {outcome.mlflow_run_id}\nMLflow UI     : {outcome.tracking_ui}",
          flush=True)


def cmd_run(args: argparse.Namespace) -> int:
    if args.resume:
        if args.config or args.overrides:
            raise InputError("--resume continues a run with its saved config; drop --config and --set")
        args.run = args.resume
        args.runs = args.runs or "runs"
        return cmd_resume(args)
    overrides = list(args.overrides) + ([f"run.out_dir={json.dumps(args.runs)}"] if args.runs else [])
    cfg = load_config(args.config, overrides)
    preflight(cfg)
    quiet_environment(args.verbose)
    launch(cfg)
    return 0


def launch(cfg: ReflowConfig):
    """Run the training flow for ``cfg`` (already checked) and print where the results are; the RunOutcome."""
    run_id = new_run_id(cfg)
    run_dir = str((Path(cfg.run.out_dir) / run_id).resolve())
    budget = f" (or until {cfg.run.max_new_groups} new groups)" if cfg.run.max_new_groups else ""
    print(f"reflow run {run_id}: mode={cfg.mode.kind} engine={cfg.rollout.engine} steps={cfg.planned_steps()}{budget} "
          f"prompts/step={cfg.rollout.prompts_per_step} samples/prompt={cfg.rollout.samples_per_prompt}", flush=True)
    with prefect_api_starting():  # the flow imports (about 8 s) while the API server starts
        from reflow.flows.rl_train import rl_train

    outcome = rl_train(config=cfg, run_dir=run_dir, run_id=run_id)
    print_outcome(outcome)
    return outcome


def cmd_model_init(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if cfg.model.path is not None:
        raise InputError("model init builds the tiny default policy; unset model.path")
    check_writable(Path(cfg.model.cache_dir), "model.cache_dir", 0)
    quiet_environment(False)
    from reflow.policies.tiny import ensure_tiny_model  # torch and transformers (about 4 s)

    print(ensure_tiny_model(cfg.model, cfg.env, cfg.run.seed, threads=cfg.resources.torch_threads))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    if args.reference:
        if args.config or args.overrides:
            raise InputError("--reference prints every field of the schema; drop --config and --set")
        print(reference_markdown(), end="")
        return 0
    print(config_to_json(load_config(args.config, args.overrides)))
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Held-out accuracy of a finished run's final model, on fresh workers (the UI's evaluate flow)."""
    run_dir = find_finished_run(args.run, args.runs)
    quiet_environment(args.verbose)
    with prefect_api_starting():  # the flow imports (about 8 s) while the API server starts
        from reflow.flows.launch import evaluate_run

    result = evaluate_run(run=args.run, runs=args.runs)
    print(f"{run_dir}: held-out accuracy {result['accuracy']:.3f}, reward mean {result['reward_mean']:.3f}, "
          f"mean response length {result['response_length_mean']:.1f} tokens", flush=True)
    return 0
