from __future__ import annotations

import json
from pathlib import Path

import pydantic
import pytest

from reflow.config.load import ConfigError, config_to_json, flat_params, load_config
from reflow.config.schema import ReflowConfig

REPO = Path(__file__).resolve().parents[2]


def test_defaults_and_shipped_configs_validate() -> None:
    assert load_config().mode.kind == "sync"
    for path in sorted((REPO / "configs").glob("*.toml")):
        load_config(path)


def test_overrides_parse_toml_literals_and_bare_strings() -> None:
    cfg = load_config(None, ["rollout.prompts_per_step=7", "train.learning_rate=3e-4", "rollout.enforce_eager=true",
                             "run.out_dir=some/dir", 'run.name="x1"'])
    assert (cfg.rollout.prompts_per_step, cfg.train.learning_rate, cfg.rollout.enforce_eager) == (7, 3e-4, True)
    assert (cfg.run.out_dir, cfg.run.name) == ("some/dir", "x1")


def test_config_is_frozen_and_round_trips_json() -> None:
    cfg = load_config()
    with pytest.raises(pydantic.ValidationError, match="Instance is frozen"):
        cfg.run.seed = 3  # type: ignore[misc]
    assert ReflowConfig.model_validate_json(config_to_json(cfg)) == cfg
    assert flat_params(cfg)["rollout.samples_per_prompt"] == str(cfg.rollout.samples_per_prompt)


@pytest.mark.parametrize("override,needle", [
    ("rollout.prompts_per_step=-1", "rollout.prompts_per_step"),
    ("rollout.engine=sglang", "rollout.engine"),
    ("env.min_terms=30", "env.min_terms must be <= env.max_terms"),
    ("model.tiny.num_heads=3", "hidden_size must be a multiple"),
    ("rollout.max_response_tokens=100000", "max_position_embeddings"),
    ("run=3", "run"),
    ("nosuch=1", "unknown field"),
    ("rollout.prompts_per_step", "expected key.path=value"),
    ("env.kind=tool_calc tools.max_calls=0", "needs tool calls: set tools.max_calls >= 1"),
    ("tools.max_output_chars=2", "tools.max_output_chars"),
])
def test_invalid_values_name_the_field(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, override.split())
    assert needle in str(err.value)


def test_every_field_is_documented() -> None:
    def walk(model: type) -> None:
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, ReflowConfig.__mro__[1]):
                walk(ann)
            else:
                assert field.description, f"{model.__name__}.{name} has no description"

    walk(ReflowConfig)
    json.loads(config_to_json(load_config()))


def test_dataset_workload_fields_are_checked() -> None:
    cfg = load_config(REPO / "configs/math.toml")
    assert cfg.env.kind == "math" and cfg.env.data_path is None
    with pytest.raises(ConfigError, match="set model.path"):
        load_config(None, ["env.kind=math", "env.data_path=data/dapo.parquet"])
    with pytest.raises(ConfigError, match="apply to env.kind 'math', 'code' or 'custom'"):
        load_config(None, ["env.data_path=d.parquet", "model.path=/m"])
    with pytest.raises(ConfigError, match="env.eval_data_path needs env.data_path"):
        load_config(None, ["env.kind=code", "env.eval_data_path=e.jsonl"])
    with pytest.raises(ConfigError, match="cannot tell the format"):
        load_config(None, ["env.kind=code", "env.data_path=d.csv", "model.path=/m"])
    assert load_config(None, ["env.kind=code", "env.data_path=d.csv", "env.data_format=jsonl",
                              "model.path=/m"]).env.data_format == "jsonl"
    with pytest.raises(ConfigError, match="env.eval_holdout_share"):
        load_config(None, ["env.kind=math", "env.eval_holdout_share=0.9"])


def test_prompt_bound_of_the_tiny_model_is_per_workload() -> None:
    load_config(None, ["env.kind=math", "env.max_prompt_tokens=300"])  # 300 + 192 <= 512
    with pytest.raises(ConfigError, match=r"env.max_prompt_tokens \(400 tokens\) exceeds"):
        load_config(None, ["env.kind=math", "env.max_prompt_tokens=400"])
    with pytest.raises(ConfigError, match="longest arith prompt"):
        load_config(None, ["env.max_terms=64"])


def test_tools_cross_checks() -> None:
    base = ["env.kind=tool_calc", "tools.max_calls=1", "env.max_operand=9999"]
    assert load_config(None, base).tools.max_calls == 1
    with pytest.raises(ConfigError, match="env.max_operand >= 100"):  # set, and too small for the workload
        load_config(None, ["env.kind=tool_calc", "tools.max_calls=1", "env.max_operand=20"])
    assert load_config(None, ["env.kind=tool_calc", "tools.max_calls=1"]).env.max_operand == 999  # unset
    with pytest.raises(ConfigError, match="rollout.scheduling='plain'"):
        load_config(None, [*base, "rollout.scheduling=sorted_on_policy"])


def test_a_retired_field_names_what_replaced_it(tmp_path) -> None:
    """``resources.elastic_engines`` (an engine at nice 19) was removed for flex workers: an old config says so."""
    with pytest.raises(ConfigError, match=r"resources.elastic_engines: removed: resources.flex_workers does its job"):
        load_config(None, ["resources.elastic_engines=1"])
    old = tmp_path / "old.toml"
    old.write_text("[resources]\nelastic_engines = 1\n")
    with pytest.raises(ConfigError, match=r"resources.elastic_engines: removed"):
        load_config(old)
    with pytest.raises(ConfigError, match=r"resources.elastic_engine: unknown field"):  # a misspelling is not
        load_config(None, ["resources.elastic_engine=1"])
    # a run's stored config.json has every field: one written before the removal still loads where it was 0
    from reflow.config.load import config_to_json, stored_config

    stored = json.loads(config_to_json(load_config(None, ["run.seed=7"])))
    stored["resources"]["elastic_engines"] = 0
    assert stored_config(json.dumps(stored), "config.json").run.seed == 7
    assert "elastic_engines" in stored["resources"]  # the caller's tree is left as it was
    stored["resources"]["elastic_engines"] = 1
    with pytest.raises(ConfigError, match=r"invalid config \(config.json\):\n  resources.elastic_engines: removed"):
        stored_config(stored, "config.json")
    # several engines run sorted rounds together (control.sorted_rounds.PooledRoundEngine)
    assert load_config(None, ["resources.engines=2", "rollout.scheduling=sorted_partial"]).resources.engines == 2


def test_new_groups_budget_bounds_the_steps_of_modes_with_full_batches_of_new_groups() -> None:
    base = ["run.total_steps=50", "rollout.prompts_per_step=32", "run.max_new_groups=960"]
    assert load_config(None, base).planned_steps() == 30  # sync: 32 new groups a step
    assert load_config(None, [*base, 'mode.kind="async"']).planned_steps() == 30
    assert load_config(None, [*base, "run.max_new_groups=1000"]).planned_steps() == 32  # rounded up
    assert load_config(None, [*base, "run.max_new_groups=0"]).planned_steps() == 50  # no budget
    reflow = load_config(None, [*base, 'mode.kind="reflow"', "buffer.replay_ratio=0.5"])
    assert reflow.planned_steps() == 50 and reflow.fresh_groups_per_step() == 16  # its end is found as it runs
    assert load_config(None, [*base, 'mode.kind="reflow"', "buffer.replay_ratio=0.9"]).fresh_groups_per_step() == 4
    with pytest.raises(ConfigError, match="run.max_new_groups"):
        load_config(None, ["run.max_new_groups=-1"])


def test_a_group_of_one_sample_is_refused_with_the_reason() -> None:
    from reflow.config.load import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.samples_per_prompt=1"])
    message = str(err.value)
    assert "rollout.samples_per_prompt: must be at least 2" in message and "advantage 0" in message
    assert "Value error" not in message
    assert load_config(None, ["rollout.samples_per_prompt=2"]).rollout.samples_per_prompt == 2


@pytest.mark.parametrize("kind", ["arith", "math", "code", "tool_calc"])
def test_every_workload_starts_with_its_own_defaults_and_nothing_else(kind: str) -> None:
    """``--set env.kind=K`` alone is a valid run: its prompts fit the tiny policy beside a full response."""
    from reflow.config.load import load_config
    from reflow.envs.base import make_env
    from reflow.policies.tokenizer import build_tokenizer

    cfg = load_config(None, [f"env.kind={kind}"])
    tokenizer = build_tokenizer()
    env = make_env(cfg.env, cfg.run.seed, tokenizer)
    for split in ("train", "eval"):
        prompts = env.prompts(split, 0, 16)
        longest = max(len(tokenizer(p.text, add_special_tokens=False)["input_ids"]) for p in prompts)
        assert longest + cfg.rollout.max_response_tokens <= cfg.model.tiny.max_position_embeddings, (kind, longest)
    # what the workload needed was filled in only where the config left it unset
    assert load_config(None, [f"env.kind={kind}", "env.max_prompt_tokens=100"]).env.max_prompt_tokens == 100


def test_cross_field_errors_have_no_root_label() -> None:
    from reflow.config.load import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.max_response_tokens=500"])
    assert "<root>" not in str(err.value) and "exceeds model.tiny.max_position_embeddings" in str(err.value)


def test_a_number_given_for_a_string_says_how_to_quote_it() -> None:
    from reflow.config.load import ConfigError, load_config

    for raw, quoted in (("1", '"1"'), ("true", '"true"')):
        with pytest.raises(ConfigError, match=f"run.name: Input should be a valid string .*is quoted: {quoted}"):
            load_config(None, [f"run.name={raw}"])
    assert load_config(None, ['run.name="1"']).run.name == "1"


def test_a_staleness_bound_by_mode_gives_each_mode_its_entry() -> None:
    table = "buffer.max_staleness_versions={sync = 8, one_step_off = 7, async = 4, reflow = 6}"
    bounds = {mode: load_config(None, [table, f'mode.kind="{mode}"']).buffer.max_staleness_versions
              for mode in ("sync", "one_step_off", "async", "reflow")}
    assert bounds == {"sync": 8, "one_step_off": 7, "async": 4, "reflow": 6}
    cfg = load_config(None, [table, 'mode.kind="async"'])  # the run stores the bound it ran with
    assert ReflowConfig.model_validate_json(config_to_json(cfg)).buffer.max_staleness_versions == 4
    # the bench's file: async at 4, the other modes at 8
    bench = REPO / "configs" / "bench.toml"
    assert [load_config(bench, [f'mode.kind="{m}"']).buffer.max_staleness_versions
            for m in ("sync", "one_step_off", "async", "reflow")] == [8, 8, 4, 8]
    # an integer override replaces the table for every mode
    assert load_config(bench, ["buffer.max_staleness_versions=3",
                               'mode.kind="reflow"']).buffer.max_staleness_versions == 3


@pytest.mark.parametrize("table,needle", [
    ("{sync = 8, async = 4}", "the table has no entry for one_step_off, reflow"),
    ("{sync = 8, one_step_off = 8, async = 4, reflow = 8, asyc = 4}", "unknown mode 'asyc'"),
    ("{sync = 8, one_step_off = 8, async = -1, reflow = 8}",
     "buffer.max_staleness_versions.async: expected an integer"),
    ("{sync = 8, one_step_off = 8, async = 4, reflow = 2.5}",
     "buffer.max_staleness_versions.reflow: expected an integer"),
])
def test_a_bad_staleness_table_names_the_mode(table: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"buffer.max_staleness_versions={table}"])
    assert needle in str(err.value)


def test_a_staleness_table_beside_a_mode_that_is_not_a_section_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="mode: Input should be a valid dictionary"):
        load_config(None, ["buffer.max_staleness_versions={sync = 8, one_step_off = 8, async = 4, reflow = 8}",
                           "mode=3"])


def test_a_stored_config_text_is_read_instead_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "exp.toml"
    path.write_text("[run]\ntotal_steps = 5\n")
    assert load_config(path, text="[run]\ntotal_steps = 7\n").run.total_steps == 7
    with pytest.raises(ConfigError, match="as stored"):
        load_config(path, text="[run\n")


@pytest.mark.parametrize("overrides,needle", [
    (["env.kind=[1]"], "env.kind: Input should be"),
    (["env.kind=arith", "model=1"], "model: Input should be a valid dictionary"),
    (["buffer.max_staleness_versions={sync = 8, one_step_off = 8, async = 4, reflow = 8}", "mode.kind=[1]"],
     "mode.kind: Input should be"),
])
def test_a_value_of_the_wrong_type_under_a_before_validator_names_the_field(overrides: list[str],
                                                                            needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(None, overrides)


def test_a_config_path_that_is_not_a_utf8_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "exp.toml"
    path.write_bytes(b"\xff\xfe[run]\n")
    with pytest.raises(ConfigError, match="is not UTF-8"):
        load_config(path)
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_a_boolean_is_not_taken_for_a_number() -> None:
    for item, field in (("run.total_steps=true", "total_steps"), ("train.learning_rate=false", "learning_rate"),
                        ("resources.num_cpus=true", "num_cpus")):
        with pytest.raises(ConfigError, match=f"{field}: expected a number, got"):
            load_config(None, [item])
    assert load_config(None, ["rollout.enforce_eager=false"]).rollout.enforce_eager is False


@pytest.mark.parametrize("field", ["run.out_dir", "model.path", "model.cache_dir", "env.data_path",
                                   "env.eval_data_path", "resources.ray_address", "tracking.tracking_uri",
                                   "storage.root"])
def test_an_empty_path_is_refused_not_taken_for_the_current_directory(field: str) -> None:
    """``--set run.out_dir=`` (a variable that expanded to nothing) would write runs into the working directory."""
    with pytest.raises(ConfigError, match=f"{field}: String should have at least 1 character"):
        load_config(None, [f'{field}=""'])
