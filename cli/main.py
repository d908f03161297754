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
from reflow.cli.simulate import cmd_simulate
from reflow.cli.tables import cmd_maintain, cmd_query
from reflow.cli.train import cmd_config, cmd_evaluate, cmd_model_init, cmd_resume, cmd_run
from reflow.config.load import ConfigError, InputError
from reflow.infra.signals import INTERRUPTED, interrupt_on_signals


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", metavar="FILE", help="TOML experiment file (default: built-in defaults)")
    p.add_argument("--set", "-s", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override a config field, e.g. --set rollout.prompts_per_step=16 (repeatable)")


RUNS_HELP = "the folder of run directories (default: runs)"


class _Renamed(argparse.Action):
    """A flag of an earlier grammar: refused with the one that replaced it (exit 2)."""

    def __init__(self, option_strings, dest, now: str, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)
        self.now = now

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} is now {self.now}")


def _add_runs_arg(p: argparse.ArgumentParser, help: str = RUNS_HELP) -> None:
    p.add_argument("--runs", metavar="DIR", default="runs", help=help)
    p.add_argument("--out", action=_Renamed, now="--runs DIR (the folder of run directories)")


def _add_output_arg(p: argparse.ArgumentParser, help: str, **kwargs) -> None:
    p.add_argument("--output", "-o", metavar=kwargs.pop("metavar", "DIR"), help=help, **kwargs)
    p.add_argument("--out", action=_Renamed, now="--output (the file or folder written)")


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN", nargs="?", help="a run directory, or a run id under --runs "
                   "(default: the latest run)")
    p.add_argument("--runs", metavar="DIR", default="runs", help=RUNS_HELP)
    p.add_argument("--root", metavar="ROOT", help="a Delta store root instead of a run (storage.root)")
    p.add_argument("--run", dest="run_flag", action=_Renamed, now="a positional RUN")


def _add_verbose_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", "-v", action="store_true", help="show Prefect/Ray/vLLM logs")


def build_parser() -> argparse.ArgumentParser:
    """Every command, in one grammar: a named run is a positional RUN, ``--runs DIR`` is the folder of
    run directories, ``--output`` is a file or folder written, ``--config``/``--set`` build a config."""
    parser = argparse.ArgumentParser(prog="reflow", description="RL post-training that keeps every device busy.")
    parser.add_argument("--version", action="version", version=f"reflow {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="train a policy (default: tiny model, arith workload, CPU)")
    _add_config_args(run)
    run.add_argument("--runs", metavar="DIR", help="the folder of run directories (sets run.out_dir; "
                     "default: the config's, runs)")
    run.add_argument("--out", action=_Renamed, now="--runs DIR (the folder of run directories)")
    _add_verbose_arg(run)
    run.add_argument("--resume", metavar="RUN", help="continue a killed run instead (same as `reflow resume RUN`; "
                     "--config and --set are then not allowed)")
    resume = sub.add_parser("resume", help="continue a killed run from its newest checkpoint")
    resume.add_argument("run", metavar="RUN", help="a run directory, or a run id under --runs")
    _add_runs_arg(resume)
    _add_verbose_arg(resume)
    evaluate = sub.add_parser("evaluate", help="held-out accuracy of a finished run's final model")
    evaluate.add_argument("run", metavar="RUN", help="a run directory, or a run id under --runs")
    _add_runs_arg(evaluate)
    _add_verbose_arg(evaluate)
    model = sub.add_parser("model", help="model utilities")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="SUBCOMMAND")
    init = model_sub.add_parser("init", help="build (or find cached) the tiny warm-started default policy")
    _add_config_args(init)
    bench = sub.add_parser("bench-sampler", help="time the replay-buffer sampling query on a synthetic table")
    bench.add_argument("--rows", type=int, default=1_000_000, help="trajectory rows (default 1,000,000)")
    bench.add_argument("--root", metavar="ROOT", default=".cache/reflow/bench-sampler",
                       help="the Delta store root of the synthetic tables (reused if present; default "
                            ".cache/reflow/bench-sampler)")
    bench.add_argument("--rows-per-version", type=int, default=4000,
                       help="trajectory rows per policy version: the table grows by versions, as a run's does "
                            "(default 4,000)")
    bench.add_argument("--queries", type=int, default=50, help="timed selections (default 50)")
    bench.add_argument("--rebuild", action="store_true", help="delete --root and rebuild its tables (refused unless "
                       "the bench built it)")
    _add_output_arg(bench, "also write DIR/bench_sampler.json")
    eng = sub.add_parser("bench-engine", help="vLLM generated tokens/s at fixed numbers of running sequences")
    _add_config_args(eng)
    eng.add_argument("--concurrency", default="8,16,32,64,128,256", help="running sequences per point "
                     "(default 8,16,32,64,128,256)")
    eng.add_argument("--steps", type=int, default=60, help="timed engine steps per point (default 60)")
    eng.add_argument("--warmup", type=int, default=10, help="untimed engine steps before each point (default 10)")
    eng.add_argument("--prefill-tokens", default="32,128", help="then time prefilling 256 prompts of each "
                     "length (default 32,128)")
    eng.add_argument("--engines", default="", metavar="N,...",
                     help="then time data-parallel generation: the same --pool-requests dealt to N engine actors "
                          "under Ray, for each N (e.g. 1,2; default: skipped)")
    eng.add_argument("--pool-requests", type=int, default=256, metavar="K",
                     help="requests per --engines point (default 256)")
    _add_output_arg(eng, "also write DIR/bench_engine.json")
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
    _add_output_arg(modes, "where bench.json, bench.png and the runs go", required=True)
    sim = sub.add_parser("simulate", help="the modes in virtual time: the real control plane against modelled "
                         "engines and trainers (a profile), at any number of engines and trainer ranks")
    _add_config_args(sim)
    sim.add_argument("--profile", metavar="FILE", help="cost models, JSON or TOML (default: configs/profiles/"
                     "cpu.json, calibrated on this machine; configs/profiles/h100-8b.toml for GPUs)")
    sim.add_argument("--modes", default="sync,one_step_off,async,reflow",
                     help="comma-separated: sync, one_step_off, async, reflow, and the SortedRL rows "
                          "sorted_on_policy, sorted_partial (default: the four modes)")
    sim.add_argument("--seeds", default="", help="comma-separated seeds (default: 0; with --calibrate: the bench "
                     "runs to fit on, default all)")
    sim.add_argument("--equal-steps", action="store_true", help="run every mode for run.total_steps steps (default: "
                     "the same new groups, as reflow bench)")
    sim.add_argument("--bench", metavar="DIR", help="a reflow bench output: estimate time to target as its new "
                     "samples to target over the simulated rate of new samples")
    sim.add_argument("--validate", metavar="BENCH_DIR", help="simulate every mode and seed of a reflow bench "
                     "output with its config, each run replaying the response lengths and rewards its real run "
                     "generated (kept as BENCH_DIR/traces.json.gz), and print the relative error of each figure "
                     "(exit 1 if any is over 15%%)")
    sim.add_argument("--check-engine", metavar="DIR", help="compare the profile's engine step with a reflow "
                     "bench-engine output (DIR/bench_engine.json): modelled against measured tokens/s at each "
                     "number of running sequences, written to --output DIR/engine_check.json")
    sim.add_argument("--calibrate", metavar="BENCH_DIR", help="fit a CPU profile to a reflow bench output's runs "
                     "and write it to --output FILE.json")
    _add_output_arg(sim, "where sim.json and sim.png go (with --calibrate: the profile file)", required=True)
    report = sub.add_parser("bench-report", help="reflow's speedups seed by seed over one or more bench outputs")
    report.add_argument("dirs", nargs="+", metavar="DIR", help="bench output directories (or their bench.json)")
    _add_output_arg(report, "also write the figures as JSON to FILE", metavar="FILE")
    query = sub.add_parser("query", help="run SQL over a run's Delta tables (trajectories, usage, rollout_cache)")
    query.add_argument("sql", metavar="SQL", help='SQL (DataFusion dialect), e.g. "SELECT count(*) FROM trajectories"')
    _add_target_args(query)
    query.add_argument("--as-of-version", metavar="TABLE=N", action="append", default=[],
                       help="read TABLE at Delta version N (time travel; repeatable; other tables: latest)")
    _add_output_arg(query, "write the result to FILE (.csv, .parquet or .jsonl) instead of printing it",
                    metavar="FILE")
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
    repro.add_argument("run", metavar="RUN", help="the original: its MLflow run id, or its run directory")
    repro.add_argument("--tracking-uri", metavar="URI", help="MLflow store holding the run (default: "
                       "DIR/mlflow.db of --runs, else $MLFLOW_TRACKING_URI, else runs/mlflow.db)")
    repro.add_argument("--runs", metavar="DIR", help="the folder the original was written under: its "
                       "mlflow.db is the store, and the repeat goes there too (default: the original's run.out_dir)")
    repro.add_argument("--out", action=_Renamed, now="--runs DIR (the folder of run directories)")
    repro.add_argument("--tolerance", type=float, default=0.0, help="largest |difference| per metric and weight "
                       "that still counts as matched (default 0: bit-identical)")
    repro.add_argument("--check", action="store_true", help="exit 1 if the repeat does not match")
    repro.add_argument("--no-checkpoints", action="store_true", help="do not check or compare the original's "
                       "checkpoints (e.g. they were deleted)")
    _add_verbose_arg(repro)
    serve = sub.add_parser("serve", help="start a Prefect server and serve the train/evaluate/bench deployments "
                           "(launch and watch runs in its UI)")
    serve.add_argument("--host", default="127.0.0.1", help="server address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=4200, help="server port (default 4200)")
    serve.add_argument("--api-url", metavar="URL", default=os.environ.get("PREFECT_API_URL"),
                       help="use the Prefect server already at URL (e.g. http://host:4200/api) instead of "
                            "starting one (default: $PREFECT_API_URL)")
    _add_runs_arg(serve, "the folder of run directories the forms launch into (run.out_dir, with MLflow's "
                  "sqlite store) and the benchmark's output (default: runs)")
    show = sub.add_parser("config", help="print the resolved config as JSON (or every field: --reference)")
    _add_config_args(show)
    show.add_argument("--reference", action="store_true", help="print the configuration reference (every field, "
                      "its default, bounds and description) as Markdown: docs/configuration.md")
    return parser


def _flag_rows(parser: argparse.ArgumentParser, command: str) -> list[tuple[str, str, str]]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                rows += _flag_rows(sub, f"{command} {name}")
        elif not isinstance(action, argparse._HelpAction) and action.help != argparse.SUPPRESS:
            name = ", ".join(action.option_strings) or action.metavar or action.dest
            value = action.metavar or ""
            if action.option_strings and action.nargs != 0 and not value:
                value = action.dest.upper()
            name += {"?": " (optional)", "+": "..."}.get(action.nargs, "") if not action.option_strings else ""
            required = " (required)" if action.option_strings and action.required else ""
            rows.append((command, f"`{name}`" + (f" {value}" if action.option_strings and value else "") + required,
                         (action.help or "").replace("%%", "%").replace("|", "\\|")))
    return rows


def cli_reference() -> str:
    """docs/cli.md: every command and flag, from the parser (a test keeps the file in step)."""
    lines = ["# Command line", "",
             "Generated from `cli/main.py` (`reflow COMMAND --help` says the same); regenerate with",
             "`python -c 'from reflow.cli.main import cli_reference; print(cli_reference(), end=\"\")' > docs/cli.md`.",
             "", "One grammar: a run is a positional `RUN` (a run directory, or a run id under `--runs`); `--runs DIR`",
             "is the folder of run directories; `--output` is the file or folder a command writes; `--config`",
             "and `--set` build a config. The flags of earlier versions (`--out`, `--run`) are refused with",
             "the one that replaced them.", "", "| command | argument | meaning |", "|---|---|---|"]
    lines += [f"| `{command}` | {name} | {help} |" for command, name, help in _flag_rows(build_parser(), "reflow")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``reflow`` script."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `reflow query SQL --max-rows 5 RUN`: argparse (3.11) gives the optional RUN up once SQL is read
    if len(extra) == 1 and getattr(args, "run", "") is None and not extra[0].startswith("-"):
        args.run, extra = extra[0], []
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    interrupt_on_signals()
    handlers = {"run": cmd_run, "resume": cmd_resume, "evaluate": cmd_evaluate, "serve": cmd_serve,
                "config": cmd_config, "bench-sampler": cmd_bench_sampler, "bench-engine": cmd_bench_engine,
                "bench": cmd_bench, "bench-report": cmd_bench_report, "simulate": cmd_simulate,
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
