"""From stored trajectories to trainer samples (advantages per whole GRPO group)."""

from __future__ import annotations

import pyarrow as pa
import torch

from reflow.config.schema import TrainConfig
from reflow.policies.losses import get_advantage_estimator
from reflow.policies.trainer import TrainSample


def train_samples_from_table(table: pa.Table, loss_weights: dict[str, float],
                             cfg: TrainConfig | None = None) -> list[TrainSample]:
    """Rows of the trajectories table to ``TrainSample``s.

    Advantages come from the estimator ``cfg.advantage_estimator`` names
    (``policies.losses``; default config: GRPO), over the rows of each ``group_id`` present in
    ``table`` (callers keep groups whole). ``loss_weights`` maps trajectory id
    to its weight; missing ids get 1.0.
    """
    cols = table.to_pydict()
    groups = {g: i for i, g in enumerate(dict.fromkeys(cols["group_id"]))}
    rewards = torch.tensor(cols["reward"], dtype=torch.float64)
    index = torch.tensor([groups[g] for g in cols["group_id"]], dtype=torch.long)
    cfg = cfg or TrainConfig()
    adv = get_advantage_estimator(cfg.advantage_estimator)(rewards, index, cfg).tolist() if len(rewards) else []
    return [
        TrainSample(prompt_tokens=list(cols["prompt_tokens"][i]), response_tokens=list(cols["response_tokens"][i]),
                    behaviour_logprobs=list(cols["behaviour_logprobs"][i]), loss_mask=list(cols["loss_mask"][i]),
                    advantage=float(adv[i]), loss_weight=float(loss_weights.get(cols["trajectory_id"][i], 1.0)))
        for i in range(table.num_rows)
    ]
