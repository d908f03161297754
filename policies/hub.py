"""``model.path`` as a directory or as a Hugging Face Hub id, resolved from the local cache (never downloaded).

``Qwen/Qwen2.5-0.5B-Instruct`` names the snapshot of that repository that the
local Hugging Face cache holds (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``,
else ``~/.cache/huggingface/hub``): its ``refs/main``, or ``org/name@revision`` for
another branch, tag or full commit hash. Nothing is fetched: a run never downloads weights.
"""

from __future__ import annotations

import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


class ModelNotFound(ValueError):
    """``model.path`` is neither a model directory nor a Hub id the local cache holds; the message says which."""


def is_hub_id(path: str) -> bool:
    """Whether ``path`` reads as ``org/name`` (or ``org/name@revision``) rather than a file path."""
    return bool(HUB_ID.match(path)) and not path.startswith((".", "/", "~"))


def local_model_dir(path: str) -> Path:
    """The directory ``path`` names: itself when it is one, else the cached snapshot of Hub id ``path``."""
    direct = Path(path).expanduser()
    if direct.is_dir():
        if not (direct / "config.json").is_file():
            raise ModelNotFound(f"model.path: {path!r} is not a Hugging Face model directory (no config.json)")
        return direct.resolve()
    if not is_hub_id(path):
        raise ModelNotFound(f"model.path: {path!r} does not exist or is not a directory")
    repo, _, revision = path.partition("@")
    # huggingface_hub's download machinery takes half a second to import: only when a Hub id is given
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        found = Path(snapshot_download(repo, revision=revision or None, local_files_only=True))
    except LocalEntryNotFoundError:
        raise ModelNotFound(f"model.path: {path!r} is no directory, and the local Hugging Face cache has no "
                            f"snapshot of {path!r} (runs never download: "
                            "fetch it with `huggingface-cli download` where the network is, or give a directory)"
                            ) from None
    if not (found / "config.json").is_file():
        raise ModelNotFound(f"model.path: the cached snapshot of {repo!r} ({found}) has no config.json")
    return found
