"""The ``reflow`` command: its arguments, and which module answers each subcommand.

Parsing and config validation import nothing heavy, so ``reflow --help`` and
config errors answer at once; torch, Ray, vLLM, Prefect and MLflow load only
when a command needs them (in the command's module). Exit codes: 0 success,
1 the run failed, 2 bad input (config, model path, table path), 130
interrupted (Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import argparse
import os
import sys

from reflow import __version__
from reflow.cli.bench import cmd_bench, cmd_bench_engine, cmd_bench_report, cmd_bench_sampler
from reflow.cli.reproduce import cmd_reproduce
from reflow.cli.runtime import EXIT_BAD_INPUT, disk_error
from reflow.cli.serve import cmd_serve
from reflow.cli.tables import cmd_maintain, cmd_query
from reflow.cli.train import cmd_config, cmd_evaluate, cmd_model_init, cmd_resume, cmd_run
from reflow.config.load import ConfigError, InputError
from reflow.infra.signals import INTERRUPTED, interrupt_on_signals


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
    parser.add_argument("--version", action="version", version=f"reflow {__version__}")
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
    evaluate = sub.add_parser("evaluate", help="held-out accuracy of a finished run's final model")
    evaluate.add_argument("run", metavar="RUN", help="the run directory, or a run id under --out")
    evaluate.add_argument("--out", metavar="DIR", default="runs", help="where run ids are looked up (default: runs)")
    evaluate.add_argument("--verbose", "-v", action="store_true", help="show Prefect/Ray/vLLM logs")
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
    show = sub.add_parser("config", help="print the resolved config as JSON (or every field: --reference)")
    _add_config_args(show)
    show.add_argument("--reference", action="store_true", help="print the configuration reference (every field, "
                      "its default, bounds and description) as Markdown: docs/configuration.md")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``reflow`` script."""
    args = build_parser().parse_args(argv)
    interrupt_on_signals()
    handlers = {"run": cmd_run, "resume": cmd_resume, "evaluate": cmd_evaluate, "serve": cmd_serve, "config": cmd_config,
                "bench-sampler": cmd_bench_sampler, "bench-engine": cmd_bench_engine, "bench": cmd_bench,
                "bench-report": cmd_bench_report,
                "query": cmd_query, "maintain": cmd_maintain, "reproduce": cmd_reproduce}
    handler = cmd_model_init if args.command == "model" else handlers[args.command]
    try:
        code = handler(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below, not at interpreter exit
        return code
    except (ConfigError, InputError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # `reflow config | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would fail again
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        disk = disk_error(exc)
        if disk is not None and not INTERRUPTED.is_set():
            print(f"error: {disk.strerror} writing {disk.filename or 'a file'}; free space (or make it writable) "
                  "and continue a stopped run with `reflow resume RUN`", file=sys.stderr)
            return EXIT_BAD_INPUT
        if not INTERRUPTED.is_set():
            raise
        print(f"interrupted (while stopping: {type(exc).__name__}: {exc})", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
