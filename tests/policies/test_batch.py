from __future__ import annotations

import pyarrow as pa
import pytest

from reflow.policies.batch import train_samples_from_table
from reflow.storage.schema import TRAJECTORY_SCHEMA, Trajectory, to_table


def _row(tid: str, group: str, reward: float) -> Trajectory:
    return Trajectory(trajectory_id=tid, run_id="r", prompt_id=group, group_id=group, sample_index=0, env="arith",
                      rollout_step=0, policy_version=0, prompt_tokens=[4, 5], response_tokens=[6, 7, 2],
                      behaviour_logprobs=[-1.0, -1.5, -0.5], token_versions=[0, 0, 0], loss_mask=[1, 1, 1],
                      reward=reward, correct=reward > 0, finish_reason="stop", response_length=3)


def test_advantages_are_computed_per_group_and_weights_attached() -> None:
    table: pa.Table = to_table([_row("a", "g1", 1.0), _row("b", "g2", 1.0), _row("c", "g1", 0.0),
                                _row("d", "g2", 1.0)], TRAJECTORY_SCHEMA)
    samples = train_samples_from_table(table, {"a": 0.5})
    assert [s.advantage for s in samples] == pytest.approx([1.0, 0.0, -1.0, 0.0], abs=1e-5)
    assert [s.loss_weight for s in samples] == [0.5, 1.0, 1.0, 1.0]
    assert samples[0].response_tokens == [6, 7, 2] and samples[0].behaviour_logprobs == [-1.0, -1.5, -0.5]
