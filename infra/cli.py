"""The ``reflow`` command.

Parsing and config validation import nothing heavy, so ``reflow --help`` and
config errors answer at once; torch, Ray, vLLM and Prefect load only when a
command needs them. Exit codes: 0 success, 1 the run failed, 2 bad input
(config, model path, table path), 130 interrupted (Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from reflow.infra.cli_tables import cmd_maintain, cmd_query
from reflow.infra.config import ConfigError, InputError, ReflowConfig, load_config
from reflow.infra.signals import INTERRUPTED, interrupt_on_signals

EXIT_BAD_INPUT = 2


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", metavar="FILE", help="TOML experiment file (default: built-in defaults)")
    p.add_argument("--set", "-s", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override a config field, e.g. --set rollout.prompts_per_step=16 (repeatable)")


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", metavar="RUN", help="run directory, or a run name under --runs (default: the latest run)")
    p.add_argument("--runs", metavar="DIR", default="runs", help="where run directories are (default: runs)")
    p.add_argument("--root", metavar="ROOT", help="a Delta store root instead of a run (storage.root)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reflow", description="RL post-training that keeps every device busy.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="train a policy (default: tiny model, arith workload, CPU)")
    _add_config_args(run)
    run.add_argument("--out", metavar="DIR", help="directory for run directories (sets run.out_dir)")
    run.add_argument("--verbose", "-v", action="store_true", help="show Prefect/Ray/vLLM logs")
    run.add_argument("--resume", metavar="RUN", help="continue a killed run instead (same as `reflow resume RUN`; "
                     "--config and --set are then not allowed)")
    resume = sub.add_parser("resume", help="continue a killed run from its newest checkpoint")
    resume.add_argument("run", metavar="RUN", help="the run directory, or a run id under --out")
    resume.add_argument("--out", metavar="DIR", default="runs", help="where run ids are looked up (default: runs)")
    resume.add_argument("--verbose", "-v", action="store_true", help="show Prefect/Ray/vLLM logs")
    model = sub.add_parser("model", help="model utilities")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="SUBCOMMAND")
    init = model_sub.add_parser("init", help="build (or find cached) the tiny warm-started default policy")
    _add_config_args(init)
    bench = sub.add_parser("bench-sampler", help="time the replay-buffer sampling query on a synthetic table")
    bench.add_argument("--rows", type=int, default=1_000_000, help="trajectory rows (default 1,000,000)")
    bench.add_argument("--root", default=".cache/reflow/bench-sampler", help="where the synthetic tables live "
                       "(reused if present)")
    bench.add_argument("--queries", type=int, default=50, help="timed selections")
    bench.add_argument("--rebuild", action="store_true", help="rebuild the tables under --root")
    bench.add_argument("--out", metavar="DIR", help="also write DIR/bench_sampler.json")
    eng = sub.add_parser("bench-engine", help="vLLM generated tokens/s at fixed numbers of running sequences")
    _add_config_args(eng)
    eng.add_argument("--concurrency", default="8,16,32,64,128,256", help="running sequences per point")
    eng.add_argument("--steps", type=int, default=60, help="timed engine steps per point (default 60)")
    eng.add_argument("--warmup", type=int, default=10, help="untimed engine steps before each point (default 10)")
    eng.add_argument("--prefill-tokens", default="32,128", help="then time prefilling 256 prompts of each length")
    eng.add_argument("--out", metavar="DIR", help="also write DIR/bench_engine.json")
    modes = sub.add_parser("bench", help="run the same workload under several modes and compare them")
    _add_config_args(modes)
    modes.add_argument("--modes", default="sync,one_step_off,async,reflow,sorted_on_policy,sorted_partial",
                       help="comma-separated rows: sync, one_step_off, async, reflow, and sorted_on_policy / "
                            "sorted_partial (sync mode with SortedRL rounds); default: all six")
    modes.add_argument("--seeds", default="0", help="comma-separated seeds (default: 0)")
    modes.add_argument("--target-accuracy", type=float, default=None,
                       help="held-out accuracy to time (default: warm-start + 75%% of sync's gain)")
    modes.add_argument("--smooth-evals", type=int, default=3, metavar="K",
                       help="read time to target and final accuracy off the trailing mean of K evaluations "
                            "(default 3; 1: single evaluations)")
    modes.add_argument("--equal-steps", action="store_true",
                       help="run every mode for run.total_steps steps (default: for run.total_steps batches' worth "
                            "of new groups, so that reflow, whose batches are partly replayed, gets the same data)")
    modes.add_argument("--out", metavar="DIR", required=True, help="where bench.json, bench.png and the runs go")
    report = sub.add_parser("bench-report", help="reflow's speedups seed by seed over one or more bench outputs")
    report.add_argument("dirs", nargs="+", metavar="DIR", help="bench output directories (or their bench.json)")
    report.add_argument("--out", metavar="FILE", help="also write the figures as JSON to FILE")
    query = sub.add_parser("query", help="run SQL over a run's Delta tables (trajectories, usage, rollout_cache)")
    query.add_argument("sql", help='SQL (DataFusion dialect), e.g. "SELECT count(*) FROM trajectories"')
    _add_target_args(query)
    query.add_argument("--as-of-version", metavar="TABLE=N", action="append", default=[],
                       help="read TABLE at Delta version N (time travel; repeatable; other tables: latest)")
    query.add_argument("--out", metavar="FILE", help="write the result to FILE (.csv, .parquet or .jsonl) "
                                                     "instead of printing it")
    query.add_argument("--max-rows", type=int, default=50, help="rows to print (default 50)")
    maint = sub.add_parser("maintain", help="compact, checkpoint and vacuum a run's Delta tables "
                                            "(refused while a run writes them)")
    _add_target_args(maint)
    maint.add_argument("--retention-hours", type=int, default=None,
                       help="vacuum files unreferenced for this many hours (default: the table's 7 days; "
                            "0 keeps only the current version's files and ends time travel)")
    maint.add_argument("--force", action="store_true", help="run even if a writer lock looks live")
    repro = sub.add_parser("reproduce", help="start a new run from an MLflow run's record and compare it with "
                                             "the original")
    repro.add_argument("run", metavar="MLFLOW_RUN_ID", help="the original's MLflow run id (or its run directory)")
    repro.add_argument("--tracking-uri", metavar="URI", help="MLflow store holding the run (default: "
                       "$MLFLOW_TRACKING_URI, else runs/mlflow.db)")
    repro.add_argument("--out", metavar="DIR", help="the directory the original was written under: its "
                       "mlflow.db is the store, and the repeat goes there too")
    repro.add_argument("--tolerance", type=float, default=0.0, help="largest |difference| per metric and weight "
                       "that still counts as matched (default 0: bit-identical)")
    repro.add_argument("--check", action="store_true", help="exit 1 if the repeat does not match")
    repro.add_argument("--no-checkpoints", action="store_true", help="do not check or compare the original's "
                       "checkpoints (e.g. they were deleted)")
    repro.add_argument("--verbose", "-v", action="store_true", help="show Prefect/Ray/vLLM logs")
    serve = sub.add_parser("serve", help="start a Prefect server and serve the train/evaluate/bench deployments "
                           "(launch and watch runs in its UI)")
    serve.add_argument("--host", default="127.0.0.1", help="server address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=4200, help="server port (default 4200)")
    serve.add_argument("--api-url", metavar="URL", default=os.environ.get("PREFECT_API_URL"),
                       help="use the Prefect server already at URL (e.g. http://host:4200/api) instead of "
                            "starting one (default: $PREFECT_API_URL)")
    serve.add_argument("--out", metavar="DIR", default="runs", help="the form's default run.out_dir (where "
                       "launched runs and MLflow's sqlite store go) and the benchmark's output (default: runs)")
    show = sub.add_parser("config", help="print the resolved config as JSON")
    _add_config_args(show)
    return parser


def _quiet_environment(verbose: bool) -> None:
    """Keep the console to progress lines unless --verbose (set before the libraries load)."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    # The ephemeral Prefect API's 20 s start-up limit is exceeded on a loaded machine (a failed run, not a slow one).
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    if verbose:
        os.environ["REFLOW_VERBOSE"] = "1"
    else:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
        # The ephemeral Prefect server logs a CancelledError traceback through the root logger
        # when it is stopped at exit (a race in its sqlite pool); keep the root logger quiet.
        os.environ.setdefault("PREFECT_LOGGING_ROOT_LEVEL", "CRITICAL")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("RAY_LOG_TO_DRIVER_EVENT_LEVEL", "ERROR")


def _prefect_api() -> None:
    """Start the ephemeral Prefect API now (unless PREFECT_API_URL names a server), with a watchdog that
    stops it if this process is killed before its exit handlers run."""
    from reflow.infra.prefect_api import start_ephemeral_server

    start_ephemeral_server()


def preflight(cfg: ReflowConfig) -> None:
    """Check paths the config names, before anything is created. Raises InputError."""
    if cfg.model.path is not None:
        path = Path(cfg.model.path)
        if not path.is_dir():
            raise InputError(f"model.path: {str(path)!r} does not exist or is not a directory")
        if not (path / "config.json").is_file():
            raise InputError(f"model.path: {str(path)!r} is not a Hugging Face model directory (no config.json)")
    if cfg.env.data_path is not None:  # read and parse the dataset now: a bad file exits 2 before any write
        from reflow.envs.base import env_class
        from reflow.envs.datasets import DatasetError, check_dataset

        try:
            check_dataset(cfg.env, env_class(cfg.env.kind))
        except DatasetError as exc:
            raise InputError(f"env.data_path: {exc}") from None
    out = Path(cfg.run.out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"run.out_dir: {str(out)!r} exists and is not a directory")
    if cfg.storage.root is not None:
        from reflow.storage.delta_store import DeltaTrajectoryStore, StorageError

        try:
            DeltaTrajectoryStore(cfg.storage.root).table_versions()
        except StorageError as exc:
            raise InputError(f"storage.root: {exc}") from None


def find_run(run: str, out: str | None) -> Path:
    """The directory of run ``run`` (a path, or a run id under ``out``); InputError if it is not a run."""
    candidates = [Path(run)] + ([Path(out) / run] if out and not Path(run).is_absolute() else [])
    for path in candidates:
        if (path / "run.json").is_file() and (path / "config.json").is_file():
            return path.resolve()
    raise InputError(f"{run!r} is not a run directory (no run.json and config.json in "
                     f"{' or '.join(str(p) for p in candidates)})")


def _cmd_resume(args: argparse.Namespace) -> int:
    run_dir = find_run(args.run, args.out)
    from reflow.infra.config import config_to_json

    try:
        cfg = ReflowConfig.model_validate_json((run_dir / "config.json").read_text())
        record = json.loads((run_dir / "run.json").read_text())
        run_id = record["run_id"]
    except (ValueError, KeyError) as exc:
        raise InputError(f"{run_dir}: unreadable config.json or run.json: {exc}") from None
    _quiet_environment(args.verbose)
    print(f"reflow resume {run_id}: mode={cfg.mode.kind} steps={cfg.run.total_steps}", flush=True)
    _prefect_api()
    from reflow.flows.rl_train import rl_train

    outcome = rl_train(config_json=config_to_json(cfg), run_dir=str(run_dir), run_id=run_id, resume=True)
    _print_outcome(outcome)
    return 0


def _print_outcome(outcome) -> None:
    print(f"\nrun directory : {outcome.run_dir}\ncurves        : {outcome.curves_png}\n"
          f"final model   : {outcome.final_model}\nDelta tables  : {outcome.store_root}/trajectories, "
          f"{outcome.store_root}/usage\nMLflow run    : {outcome.mlflow_run_id}\nMLflow UI     : {outcome.tracking_ui}",
          flush=True)


def _cmd_run(args: argparse.Namespace) -> int:
    if args.resume:
        if args.config or args.overrides:
            raise InputError("--resume continues a run with its saved config; drop --config and --set")
        args.run = args.resume
        args.out = args.out or "runs"
        return _cmd_resume(args)
    overrides = list(args.overrides) + ([f"run.out_dir={json.dumps(args.out)}"] if args.out else [])
    cfg = load_config(args.config, overrides)
    preflight(cfg)
    _quiet_environment(args.verbose)
    _launch(cfg)
    return 0


def _launch(cfg: ReflowConfig):
    """Run the training flow for ``cfg`` (already checked) and print where the results are; the RunOutcome."""
    from reflow.infra.config import config_to_json
    from reflow.infra.run import new_run_id

    run_id = new_run_id(cfg)
    run_dir = str((Path(cfg.run.out_dir) / run_id).resolve())
    budget = f" (or until {cfg.run.max_new_groups} new groups)" if cfg.run.max_new_groups else ""
    print(f"reflow run {run_id}: mode={cfg.mode.kind} engine={cfg.rollout.engine} steps={cfg.planned_steps()}{budget} "
          f"prompts/step={cfg.rollout.prompts_per_step} samples/prompt={cfg.rollout.samples_per_prompt}", flush=True)
    _prefect_api()
    from reflow.flows.rl_train import rl_train

    outcome = rl_train(config_json=config_to_json(cfg), run_dir=run_dir, run_id=run_id)
    _print_outcome(outcome)
    return outcome


def _cmd_model_init(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if cfg.model.path is not None:
        raise InputError("model init builds the tiny default policy; unset model.path")
    _quiet_environment(False)
    from reflow.policies.tiny import ensure_tiny_model

    print(ensure_tiny_model(cfg.model, cfg.env, cfg.run.seed, threads=cfg.resources.torch_threads))
    return 0


def _cmd_bench_sampler(args: argparse.Namespace) -> int:
    if args.rows < 1000 or args.queries < 1:
        raise InputError("--rows must be >= 1000 and --queries >= 1")
    from reflow.storage.bench import bench_sampler

    print(f"building/reusing {args.rows:,} trajectory rows under {args.root} ...", flush=True)
    figures = bench_sampler(args.rows, args.root, queries=args.queries, rebuild=args.rebuild)
    text = json.dumps(figures, indent=2)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_sampler.json").write_text(text)
    return 0


def _int_list(text: str, flag: str) -> list[int]:
    """Comma-separated integers of option ``flag``; InputError naming it otherwise."""
    try:
        return [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise InputError(f"{flag}: expected comma-separated integers, got {text!r}") from None


def _cmd_bench_engine(args: argparse.Namespace) -> int:
    levels = _int_list(args.concurrency, "--concurrency")
    prefill_lengths = _int_list(args.prefill_tokens, "--prefill-tokens")
    if prefill_lengths and min(prefill_lengths) < 1:
        raise InputError("--prefill-tokens values must be >= 1")
    if not levels or min(levels) < 1 or args.steps < 1 or args.warmup < 0:
        raise InputError("--concurrency values and --steps must be >= 1, --warmup >= 0")
    cfg = load_config(args.config, args.overrides)
    if cfg.rollout.engine != "vllm":
        raise InputError("bench-engine measures the vLLM engine; set rollout.engine = \"vllm\"")
    _quiet_environment(False)
    os.environ["OMP_NUM_THREADS"] = str(cfg.resources.torch_threads)  # as the engine actor runs (before torch loads)
    from reflow.infra.engine_bench import bench_engine

    figures = bench_engine(cfg, levels, args.steps, args.warmup, prefill_lengths,
                           progress=lambda line: print(line, flush=True))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_engine.json").write_text(json.dumps(figures, indent=2))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    known = ("sync", "one_step_off", "async", "reflow", "sorted_on_policy", "sorted_partial")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in known]
    if not modes or bad:
        raise InputError(f"--modes: unknown mode(s) {bad or modes}; choose from {', '.join(known)}")
    seeds = _int_list(args.seeds, "--seeds")
    if not seeds:
        raise InputError("--seeds: give at least one seed")
    if args.target_accuracy is not None and not 0 < args.target_accuracy <= 1:
        raise InputError(f"--target-accuracy must be in (0, 1], got {args.target_accuracy}")
    if args.smooth_evals < 1:
        raise InputError(f"--smooth-evals must be >= 1, got {args.smooth_evals}")
    cfg = load_config(args.config, args.overrides)  # validate once, before any run starts
    preflight(cfg)
    if cfg.env.eval_prompts == 0:
        raise InputError("env.eval_prompts: the benchmark needs held-out prompts (> 0)")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out: {str(out)!r} exists and is not a directory")
    _quiet_environment(False)
    _prefect_api()
    from reflow.flows.bench import bench_flow

    bench_flow(config=args.config, overrides=list(args.overrides), modes=modes, seeds=seeds, out=str(out.resolve()),
               target=args.target_accuracy, smooth_evals=args.smooth_evals, equal_data=not args.equal_steps)
    return 0


def _cmd_bench_report(args: argparse.Namespace) -> int:
    from reflow.infra import bench, bench_limits

    if args.out and (Path(args.out).is_dir() or not Path(args.out).parent.is_dir()):
        raise InputError(f"--out: {args.out!r} must be a file in an existing directory")
    results = []
    for item in args.dirs:
        path = Path(item)
        if not (path / "bench.json" if path.is_dir() else path).is_file():
            raise InputError(f"{item}: no bench.json there (run reflow bench --out {item} first)")
        try:
            results += bench.load_results(path)
        except ValueError as exc:
            raise InputError(str(exc)) from exc
    if not any(r.mode == "reflow" for r in results):
        raise InputError(f"no reflow rows in {', '.join(args.dirs)}")
    speedups = bench.seed_speedups(results)
    limits = bench_limits.speed_limits(results)
    print(bench.seed_table(speedups) + "\n\n" + bench_limits.limits_table(limits), flush=True)
    if args.out:
        tmp = Path(args.out).with_name(Path(args.out).name + ".tmp")
        tmp.write_text(json.dumps({**speedups, "limits": limits}, indent=2))
        tmp.replace(args.out)
    return 0


def _cmd_reproduce(args: argparse.Namespace) -> int:
    from reflow.infra.reproduce import ReproduceError, check_inputs, fetch_manifest, locate, open_client

    if not 0 <= args.tolerance < float("inf"):
        raise InputError("--tolerance must be a finite number >= 0")
    try:
        tracking_uri, original_id = locate(args.run, args.tracking_uri, args.out)
        client = open_client(tracking_uri)
        manifest = fetch_manifest(client, original_id, tracking_uri)
        try:
            cfg = ReflowConfig.model_validate(manifest["config"])
        except ValueError as exc:
            raise ConfigError(f"the recorded config of {original_id} is not valid with this code: {exc}") from None
        # The repeat goes under --out (else where the original went) and is tracked next to the original.
        run = cfg.run.model_copy(update={"out_dir": args.out}) if args.out else cfg.run
        cfg = cfg.model_copy(update={"run": run,
                                     "tracking": cfg.tracking.model_copy(update={"tracking_uri": tracking_uri})})
        preflight(cfg)
        warnings = check_inputs(manifest, compare_checkpoints=not args.no_checkpoints)
    except ReproduceError as exc:
        raise InputError(str(exc)) from None
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    _quiet_environment(args.verbose)
    outcome = _launch(cfg)
    return _compare_repeat(args, client, original_id, manifest, outcome)


def _compare_repeat(args: argparse.Namespace, client, original_id: str, manifest: dict, outcome) -> int:
    """Compare the repeat with the original; record the result in its run directory and MLflow run."""
    from reflow.infra.provenance import read_manifest
    from reflow.infra.reproduce import compare, format_comparison, is_timing_metric, original_metrics
    from reflow.infra.run import read_steps

    repeat = {r.step: {k: v for k, v in r.metrics.items() if not is_timing_metric(k)}
              for r in read_steps(outcome.run_dir)}
    checkpoints = [] if args.no_checkpoints else manifest.get("checkpoints", [])
    result = compare(original_metrics(client, original_id), repeat, checkpoints,
                     read_manifest(outcome.run_dir)["checkpoints"], args.tolerance)
    report = json.dumps({"original": original_id, "repeat": outcome.mlflow_run_id, **result.to_json()}, indent=2)
    (Path(outcome.run_dir) / "reproduce.json").write_text(report)
    if outcome.mlflow_run_id:
        client.set_tag(outcome.mlflow_run_id, "reflow.reproduces", original_id)
        client.log_text(outcome.mlflow_run_id, report, "reproduce/comparison.json")
    print("\n" + format_comparison(result, original_id, str(outcome.mlflow_run_id)), flush=True)
    return 1 if args.check and not result.matched else 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from reflow.infra.serve import ServeError, port_in_use, serve

    if not 1 <= args.port <= 65535:
        raise InputError(f"--port must be in 1..65535, got {args.port}")
    if not args.api_url and port_in_use(args.host, args.port):
        raise InputError(f"port {args.port} on {args.host} is already in use: pass --port with a free port, or "
                         f"--api-url http://{args.host}:{args.port}/api to use a Prefect server already running there")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")  # flow-run logs (progress lines) go to the UI
    _quiet_environment(False)
    try:
        return serve(args.host, args.port, args.api_url, str(Path(args.out).resolve()))
    except ServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _cmd_config(args: argparse.Namespace) -> int:
    from reflow.infra.config import config_to_json

    print(config_to_json(load_config(args.config, args.overrides)))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``reflow`` script."""
    args = build_parser().parse_args(argv)
    interrupt_on_signals()
    handlers = {"run": _cmd_run, "resume": _cmd_resume, "serve": _cmd_serve, "config": _cmd_config,
                "bench-sampler": _cmd_bench_sampler, "bench-engine": _cmd_bench_engine, "bench": _cmd_bench,
                "bench-report": _cmd_bench_report,
                "query": cmd_query, "maintain": cmd_maintain, "reproduce": _cmd_reproduce}
    handler = _cmd_model_init if args.command == "model" else handlers[args.command]
    try:
        return handler(args)
    except (ConfigError, InputError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if not INTERRUPTED.is_set():
            raise
        print(f"interrupted (while stopping: {type(exc).__name__}: {exc})", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
