"""``reflow simulate``: the modes in virtual time against a profile, a bench's check, a profile's calibration."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from reflow.cli.runtime import check_writable, int_list
from reflow.config.load import InputError
from reflow.config.schema import ReflowConfig

PACKAGE = Path(__file__).resolve().parents[1]
DEFAULT_PROFILE = PACKAGE / "configs" / "profiles" / "cpu.json"
SIMULATED = ("sync", "one_step_off", "async", "reflow", "sorted_on_policy", "sorted_partial")  # bench.simulate.MODES


def cmd_simulate(args: argparse.Namespace) -> int:
    from reflow.bench.sim_profile import load_profile, save_profile

    out = Path(args.output)
    if args.calibrate:
        from reflow.bench.sim_calibrate import calibrate

        if out.suffix != ".json" or not out.parent.is_dir() or out.is_dir():
            raise InputError(f"--output: with --calibrate, a .json file in an existing directory, got {args.output!r}")
        check_writable(out.parent, "--output", 0)
        seeds = int_list(args.seeds, "--seeds") if args.seeds else None
        try:
            profile = calibrate(_bench_dir(args.calibrate), seeds)
        except ValueError as exc:
            raise InputError(str(exc)) from exc
        save_profile(profile, out)
        print(profile.model_dump_json(indent=1, exclude={"lengths": {"groups", "group_rewards", "by_run"}}))
        print(f"profile: {out}")
        return 0
    if out.exists() and not out.is_dir():
        raise InputError(f"--output: {str(out)!r} exists and is not a directory")
    check_writable(out, "--output", 0)  # before the work: a file above it fails only at the write otherwise
    if args.check_engine:
        return _check_engine(args, out)
    from reflow.bench import mode_bench, sim_report
    from reflow.bench.simulate import config_path

    bench = None
    if args.validate or args.bench:
        try:
            bench = mode_bench.load_results(_bench_dir(args.validate or args.bench))
            meta = mode_bench.load_meta(_bench_dir(args.validate)) if args.validate else {}
        except ValueError as exc:
            raise InputError(str(exc)) from exc
    if args.validate:
        config, overrides = config_path(args.config or meta.get("config")), [*meta.get("overrides", []),
                                                                              *args.overrides]
        pairs = [(r.mode, r.seed) for r in bench if r.mode in SIMULATED]
        equal_steps = meta.get("run_length") == "equal steps"
        text = None if args.config else meta.get("config_text")  # the file as the runs read it
        if not pairs:
            raise InputError(f"--validate: the bench has none of the simulated modes ({', '.join(SIMULATED)})")
    else:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        bad = [m for m in modes if m not in SIMULATED]
        if not modes or bad:
            raise InputError(f"--modes: unknown or not simulated {bad or modes}; choose from {', '.join(SIMULATED)}")
        if len(set(modes)) < len(modes):
            raise InputError(f"--modes: each mode once, got {args.modes!r}")
        seeds = int_list(args.seeds or "0", "--seeds")
        if not seeds or min(seeds) < 0 or len(set(seeds)) < len(seeds):  # a seed twice is the same run twice
            raise InputError(f"--seeds: give one or more different seeds >= 0, got {args.seeds!r}")
        config, overrides, equal_steps, text = args.config, args.overrides, args.equal_steps, None
        pairs = [(m, s) for s in seeds for m in modes]
    from reflow.bench.simulate import mode_config

    configs = [(m, s, mode_config(config, overrides, m, s, equal_steps, text)) for m, s in pairs]
    try:
        profile = load_profile(args.profile or DEFAULT_PROFILE)
        if args.validate:  # each run replays the lengths and rewards its real run generated
            from reflow.bench.sim_calibrate import bench_traces, unrecorded_given_up, with_traces

            for line in unrecorded_given_up(_bench_dir(args.validate)):
                print(f"warning: {line}", file=sys.stderr, flush=True)
            profile = with_traces(profile, bench_traces(_bench_dir(args.validate)))
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    results = _run_all(configs, profile)
    if bench is not None:
        results = sim_report.with_targets(results, bench)
    summary = sim_report.aggregate(results)
    validation = sim_report.validate(bench, results) if args.validate else None
    out.mkdir(parents=True, exist_ok=True)
    meta = {"config": config, "overrides": overrides, "profile": str(args.profile or DEFAULT_PROFILE),
            "profile_name": profile.name, "pairs": pairs, "equal_steps": equal_steps,
            "bench": str(args.validate or args.bench) if bench is not None else None}
    sim_report.write_json(out / "sim.json", results, summary, meta, validation)
    sim_report.plot(summary, out / "sim.png", f"reflow simulate: {profile.name}")
    print("\n" + sim_report.table(summary))
    if validation is not None:
        print("\n" + sim_report.validation_table(validation))
    print(f"\nsim.json: {out / 'sim.json'}\nplot: {out / 'sim.png'}", flush=True)
    return 0 if validation is None or validation["passed"] else 1


def _check_engine(args: argparse.Namespace, out: Path) -> int:
    """``--check-engine DIR``: the profile's engine step against a ``reflow bench-engine --output DIR``."""
    from reflow.bench.sim_calibrate import engine_check
    from reflow.bench.sim_profile import load_profile

    path = Path(args.check_engine)
    path = path if path.suffix == ".json" else path / "bench_engine.json"
    try:
        figures = json.loads(path.read_text())
        rows = engine_check(load_profile(args.profile or DEFAULT_PROFILE), figures)
    except OSError as exc:
        raise InputError(f"--check-engine: cannot read {path} ({exc.strerror}); run reflow bench-engine --output "
                         f"{args.check_engine} first") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(f"--check-engine {path}: {exc}") from exc
    print(f"{'running':>8} {'measured tok/s':>15} {'modelled tok/s':>15} {'step ms':>8} {'modelled':>9} {'error':>6}")
    for r in rows:
        print(f"{r['concurrency']:>8} {r['measured_tokens_per_s']:>15.0f} {r['modelled_tokens_per_s']:>15.0f} "
              f"{r['measured_step_ms']:>8.1f} {r['modelled_step_ms']:>9.1f} {r['error']:>6.0%}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_check.json").write_text(json.dumps({"bench_engine": str(path), "rows": rows}, indent=2))
    print(f"\nengine_check.json: {out / 'engine_check.json'}")
    return 0


def _bench_dir(path: str) -> Path:
    p = Path(path)
    p = p.parent if p.name == "bench.json" else p
    if not (p / "bench.json").is_file():
        raise InputError(f"{path}: no bench.json there (run reflow bench --output {path} first)")
    return p


def _run_all(configs: list[tuple[str, int, ReflowConfig]], profile) -> list:
    from tqdm import tqdm

    from reflow.bench.sim_report import summarise
    from reflow.bench.simulate import simulate

    results = []
    with tqdm(total=sum(c.planned_steps() for _, _, c in configs), unit="step", desc="simulating",
              mininterval=1.0) as bar:
        for mode, seed, cfg in configs:
            bar.set_postfix_str(f"{mode} seed {seed}")
            results.append(summarise(simulate(cfg, profile, seed, progress=bar.update)))
    return results
