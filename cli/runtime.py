"""What the commands that run work share: a quiet console, the Prefect API, checks of the paths a config names.

Exit codes: 0 success, 1 the run failed, 2 bad input (``EXIT_BAD_INPUT``:
config, model path, table path), 130 interrupted (Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from contextlib import AbstractContextManager
from pathlib import Path

from reflow.config.load import InputError
from reflow.config.schema import ReflowConfig
from reflow.envs.base import env_class
from reflow.envs.custom import RewardFunctionError, load_reward_function
from reflow.envs.datasets import DatasetError, check_dataset
from reflow.infra.prefect_api import ephemeral_server_starting, start_ephemeral_server
from reflow.policies.hub import ModelNotFound, local_model_dir
from reflow.storage.delta_store import DeltaTrajectoryStore
from reflow.storage.store import StorageError
from reflow.storage.tracker import DISABLED_URIS, MLflowTracker

EXIT_BAD_INPUT = 2
# Free space a run's directory must have at its start: the default run writes about 40 MiB (checkpoints, tables,
# MLflow); less ends a run half-way through with a full disk.
MIN_FREE_MIB = 64


def quiet_environment(verbose: bool) -> None:
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
        # Libraries that log through the root logger (the ephemeral server's own console: start_prefect_api).
        os.environ.setdefault("PREFECT_LOGGING_ROOT_LEVEL", "CRITICAL")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("RAY_LOG_TO_DRIVER_EVENT_LEVEL", "ERROR")


def start_prefect_api() -> None:
    """Start the ephemeral Prefect API now (unless PREFECT_API_URL names a server), with a watchdog that
    stops it if this process is killed before its exit handlers run. Its console is quiet unless --verbose."""
    start_ephemeral_server(quiet=os.environ.get("REFLOW_VERBOSE") != "1")


def prefect_api_starting() -> AbstractContextManager[None]:
    """``start_prefect_api`` for a block that imports a flow's modules: the server starts during the block (the
    two overlap, about 8 s saved on two cores) and answers when it ends."""
    return ephemeral_server_starting(quiet=os.environ.get("REFLOW_VERBOSE") != "1")


def preflight(cfg: ReflowConfig) -> None:
    """Check paths the config names, before anything is created. Raises InputError."""
    if cfg.model.path is not None:
        try:
            local_model_dir(cfg.model.path)
        except ModelNotFound as exc:
            raise InputError(str(exc)) from None
    if cfg.env.reward_function is not None:  # import it now: a bad path or module exits 2 before any write
        try:
            load_reward_function(cfg.env.reward_function)
        except RewardFunctionError as exc:
            raise InputError(str(exc)) from None
    if cfg.env.data_path is not None:  # read and parse the dataset now: a bad file exits 2 before any write
        try:
            check_dataset(cfg.env, env_class(cfg.env.kind))
        except DatasetError as exc:
            raise InputError(f"env.data_path: {exc}") from None
    out = Path(cfg.run.out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"run.out_dir: {str(out)!r} exists and is not a directory")
    check_writable(out, "run.out_dir", MIN_FREE_MIB)
    if cfg.model.path is None:  # the tiny default is built there
        check_writable(Path(cfg.model.cache_dir), "model.cache_dir", 0)
    if cfg.storage.root is not None:
        try:
            DeltaTrajectoryStore(cfg.storage.root).table_versions()
        except StorageError as exc:
            raise InputError(f"storage.root: {exc}") from None
    check_tracking_uri(cfg.tracking.tracking_uri)


def check_tracking_uri(uri: str | None) -> None:
    """InputError naming tracking.tracking_uri unless MLflow has a tracking store for its scheme (looked up as
    MLflow does, without opening the store) and it is not the file store MLflow 3 refuses. Unset and the
    ``DISABLED_URIS`` pass."""
    if uri is None or uri.strip().lower() in DISABLED_URIS:
        return
    try:
        MLflowTracker(uri, "reflow")  # opens nothing; refuses a file store
    except ValueError as exc:
        raise InputError(f"tracking.tracking_uri: {exc}") from None
    # MLflow's own lookup of a store by scheme (plugins included); importing mlflow takes about a second, paid
    # only by a run that names a tracking URI. A private name: if a later MLflow moves it, the run's start checks.
    try:
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry
    except ImportError:
        return
    try:
        _tracking_store_registry.get_store_builder(uri)
    except Exception:  # MLflow's message speaks of the model registry, not of this field
        raise InputError(f"tracking.tracking_uri: MLflow has no tracking store for {uri!r} (use "
                         f"sqlite:///<absolute path>/mlflow.db, http(s)://host:port, postgresql://..., or 'none')"
                         ) from None


def check_writable(path: Path, field: str, min_free_mib: int) -> None:
    """InputError naming ``field`` unless a file can be written where ``path`` is (or will be created) and its
    file system has ``min_free_mib`` MiB free. Writes nothing that stays: a probe file is made and removed in
    the nearest directory that exists."""
    existing = path.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(f"{field}: {str(existing)!r} is a file, so {str(path)!r} cannot be a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise InputError(f"{field}: cannot write under {str(existing)!r} ({exc.strerror}); choose a writable "
                         f"directory") from None
    free_mib = shutil.disk_usage(existing).free / 2**20
    if free_mib < min_free_mib:
        raise InputError(f"{field}: the disk of {str(existing)!r} has {free_mib:.1f} MiB free; a run needs at "
                         f"least {min_free_mib} MiB (checkpoints, Delta tables, MLflow)")


def disk_error(exc: BaseException) -> OSError | None:
    """The disk-full, read-only or quota error behind ``exc`` (itself, or its cause or context), if any."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def int_list(text: str, flag: str) -> list[int]:
    """Comma-separated integers of option ``flag``; InputError naming it otherwise."""
    try:
        return [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise InputError(f"{flag}: expected comma-separated integers, got {text!r}") from None
