"""Finding a run directory and its Delta tables from what a person types.

Used by the commands that work on finished (or running) runs: ``query``,
``maintain``, ``reproduce``. Nothing here writes; errors are ``RunNotFound``
with a message that says what was looked for and where.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

RUN_FILE = "run.json"
_STAMP = re.compile(r"-(\d{8}-\d{6}-\d{3})$")  # new_run_id's suffix


class RunNotFound(ValueError):
    """A run directory or store root could not be found or read."""


@dataclass(frozen=True)
class TableTarget:
    """Where a command's tables are: a run directory (may be None for a bare store root) and its store root."""

    run_dir: Path | None
    store_root: str
    run_id: str | None


CONFIG_FILE = "config.json"  # written first: a run in start-up has it, and its run.json follows


def _is_run_dir(path: Path) -> bool:
    return (path / RUN_FILE).is_file() or (path / CONFIG_FILE).is_file()


def _started(path: Path) -> tuple[str, float]:
    """Sort key: the timestamp in the run's name, then its config's modification time."""
    match = _STAMP.search(path.name)
    return (match.group(1) if match else "", (path / CONFIG_FILE).stat().st_mtime
            if (path / CONFIG_FILE).is_file() else (path / RUN_FILE).stat().st_mtime)


def latest_run(runs_dir: str | Path) -> Path:
    """The most recently started run under ``runs_dir``."""
    root = Path(runs_dir)
    if not root.is_dir():
        raise RunNotFound(f"no runs directory {str(root)!r}; name the run (a directory) or its folder (--runs DIR)")
    runs = [p for p in root.iterdir() if p.is_dir() and _is_run_dir(p)]
    if not runs:
        raise RunNotFound(f"no run directories (with {CONFIG_FILE} or {RUN_FILE}) under {str(root)!r}; "
                          "name the run's directory")
    return max(runs, key=_started)


def resolve_run_dir(run: str | None, runs_dir: str | Path = "runs") -> Path:
    """``run`` as a run directory path or a run name under ``runs_dir``; None: the latest run there."""
    if run is None:
        return latest_run(runs_dir).resolve()
    direct = Path(run)
    if _is_run_dir(direct):
        return direct.resolve()
    named = Path(runs_dir) / run
    if _is_run_dir(named):
        return named.resolve()
    hint = ""
    if direct.is_dir() and any((direct / name / "_delta_log").is_dir() for name in ("trajectories", "usage")):
        hint = " (it holds Delta tables: pass it as --root instead)"
    elif direct.is_dir():
        hint = f" (the directory exists but has no {CONFIG_FILE} or {RUN_FILE})"
    raise RunNotFound(f"{run!r} is not a run directory{hint}, and there is no run {run!r} under {str(runs_dir)!r}")


def read_run_json(run_dir: Path) -> dict:
    """The run's ``run.json`` as a dict; RunNotFound if unreadable.

    A run still starting has only ``config.json``: its tables' root follows from the config
    (``storage.root``, else ``<run dir>/tables``), as the run will record it.
    """
    if not (run_dir / RUN_FILE).is_file():
        try:
            config = json.loads((run_dir / CONFIG_FILE).read_text())
        except (OSError, ValueError) as exc:
            raise RunNotFound(f"{run_dir / CONFIG_FILE} cannot be read: {exc}") from None
        storage = (config.get("storage") or {}) if isinstance(config, dict) else None
        root = storage.get("root") if isinstance(storage, dict) else None
        if not isinstance(storage, dict) or not isinstance(root, str | None):
            raise RunNotFound(f"{run_dir / CONFIG_FILE} is not a reflow run config (expected an object whose "
                              f"storage.root is a path or unset)")
        return {"run_id": run_dir.name, "store_root": root or str(run_dir.resolve() / "tables")}
    try:
        data = json.loads((run_dir / RUN_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise RunNotFound(f"{run_dir / RUN_FILE} cannot be read: {exc}") from None
    if not isinstance(data, dict) or "store_root" not in data:
        raise RunNotFound(f"{run_dir / RUN_FILE} is not a reflow run record (no store_root)")
    return data


def resolve_target(run: str | None, root: str | None, runs_dir: str | Path = "runs") -> TableTarget:
    """The tables a command should use: ``--root`` as given, else the run's (RUN or the latest)."""
    if run is not None and root is not None:
        raise RunNotFound("give RUN or --root, not both")
    if root is not None:
        if "://" not in root and not Path(root).is_dir():
            raise RunNotFound(f"--root: {root!r} is not a directory")
        return TableTarget(run_dir=None, store_root=root, run_id=None)
    run_dir = resolve_run_dir(run, runs_dir)
    record = read_run_json(run_dir)
    return TableTarget(run_dir=run_dir, store_root=str(record["store_root"]), run_id=record.get("run_id"))

