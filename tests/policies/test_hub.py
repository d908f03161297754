"""``model.path`` as a Hub id: the snapshot the local Hugging Face cache holds, never a download."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from reflow.policies.hub import ModelNotFound, is_hub_id, local_model_dir


def hub_cache_entry(cache: Path, repo: str, model_dir: Path, revision: str = "0123abcd" * 5) -> Path:
    """Lay ``model_dir`` out as the Hub cache does: ``models--org--name/snapshots/<rev>`` and ``refs/main``."""
    entry = cache / ("models--" + repo.replace("/", "--"))
    snapshot = entry / "snapshots" / revision
    shutil.copytree(model_dir, snapshot)
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(revision)
    return snapshot


def test_a_hub_id_names_the_cached_snapshot(random_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    import huggingface_hub.constants
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = hub_cache_entry(tmp_path / "hub", "tiny-org/tiny-model", random_model_dir)
    assert local_model_dir("tiny-org/tiny-model") == snapshot
    assert local_model_dir("tiny-org/tiny-model@" + "0123abcd" * 5) == snapshot  # a commit
    model = AutoModelForCausalLM.from_pretrained(local_model_dir("tiny-org/tiny-model"))
    assert model.config.hidden_size == 64 and AutoTokenizer.from_pretrained(snapshot).eos_token_id is not None
    with pytest.raises(ModelNotFound, match="local Hugging Face cache has no snapshot of 'tiny-org/other'"):
        local_model_dir("tiny-org/other")


def test_directories_are_taken_as_they_are(random_model_dir: Path, tmp_path: Path) -> None:
    assert local_model_dir(str(random_model_dir)) == random_model_dir.resolve()
    with pytest.raises(ModelNotFound, match="no config.json"):
        local_model_dir(str(tmp_path))
    with pytest.raises(ModelNotFound, match="does not exist"):
        local_model_dir("./not/here/at/all")
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("org/name@v1.0")
    assert not is_hub_id("./org/name") and not is_hub_id("/models/x") and not is_hub_id("a/b/c")
