"""config/config.yaml against config/schema.yaml and the cross-field rules: every bad value is one
line naming its key path and the value, never a traceback."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persistentkv import configuration
from persistentkv.errors import PKVError
from persistentkv.spec import AttentionSpec

ROOT = Path(__file__).resolve().parents[1]
CONFIG_PATH = ROOT / "config" / "config.yaml"


@pytest.fixture(scope="module")
def base() -> dict:
    return yaml.safe_load(CONFIG_PATH.read_text())


def broken(base: dict, path: tuple, value) -> dict:
    """A copy of ``base`` with the value at ``path`` replaced (or deleted when value is DELETE)."""
    config = copy.deepcopy(base)
    node = config
    for key in path[:-1]:
        node = node[key]
    if value is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return config


DELETE = object()


def error_of(config: dict) -> str:
    with pytest.raises(PKVError) as info:
        configuration.validate_config(config, base_dir=ROOT)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("config: ")
    return message


def test_committed_config_is_valid():
    config = configuration.load_config(CONFIG_PATH, base_dir=ROOT)
    assert configuration.spec(config) == AttentionSpec(32, 8, 128, 16, "float16")
    assert configuration.all_seeds(config)[0] == configuration.calibration_seed(config) == 20260622
    assert len(set(configuration.all_seeds(config))) == 6


@pytest.mark.parametrize("path, value, expected", [
    (("traces", 1, "max_active"), 0, "config: traces[1].max_active: 0 is less than the minimum of 1"),
    (("spec", "page_size"), 24, "config: spec.page_size: 24 is not one of [1, 2, 4, 8, 16, 32, 64, 128, 256]"),
    (("spec", "head_dim"), "128", "config: spec.head_dim: '128' is not one of [64, 128, 256]"),
    (("spec", "num_kv_heads"), 2.5, "config: spec.num_kv_heads: 2.5 is not of type 'integer'"),
    (("seeds", "calibration"), 2**32, "config: seeds.calibration: 4294967296 is greater than the maximum"),
    (("seeds", "calibration"), -1, "config: seeds.calibration: -1 is less than the minimum of 0"),
    (("seeds", "holdout"), [5, 5], "config: seeds.holdout: [5, 5] has non-unique elements"),
    (("hardware", "target"), "NVIDIA H200", "config: hardware.target: 'NVIDIA H200' does not match"),
    (("hardware", "gpu_job_threads"), 0, "config: hardware.gpu_job_threads: 0 is less than the minimum of 1"),
    (("hardware", "kernel_archs"), ["sm90"], "config: hardware.kernel_archs[0]: 'sm90' does not match"),
    (("traces", 0, "kind"), "poisson", "config: traces[0].kind: 'poisson' is not one of"),
    (("traces", 6, "path"), DELETE, "config: traces[6]: missing required key 'path'"),
    (("traces", 0, "num_requests"), DELETE, "config: traces[0]: missing required key 'num_requests'"),
    (("policy",), DELETE, "config: (top level): missing required key 'policy'"),
    (("validation", "cpu", "rtol"), "1e-3", "config: validation.cpu.rtol: '1e-3' is a string, not a number"),
    (("measure", "fragmented", "hole_fraction"), 0.99, "config: measure.fragmented.hole_fraction: 0.99 is greater"),
    (("measure", "protocols", "batch_sweep"), ["graph"], "config: measure.protocols.batch_sweep[0]: 'graph' is not one"),
    (("measure", "protocols", "batch_sweep"), [], "config: measure.protocols.batch_sweep: [] should be non-empty"),
    (("reproduce", "ratio_rtol"), 0, "config: reproduce.ratio_rtol: 0 is less than or equal to the minimum of 0"),
    (("reproduce", "time_rtol"), 1.5, "config: reproduce.time_rtol: 1.5 is greater than the maximum of 1"),
    (("reproduce", "measured"), "", "config: reproduce.measured: '' should be non-empty"),
])
def test_schema_errors_name_key_and_value(base, path, value, expected):
    assert error_of(broken(base, path, value)).startswith(expected)


@pytest.mark.parametrize("where", [(), ("spec",), ("traces", 2), ("ablations", "splits")])
def test_unknown_keys_are_rejected_everywhere(base, where):
    config = copy.deepcopy(base)
    node = config
    for key in where:
        node = node[key]
    node["colour"] = "blue"
    message = error_of(config)
    prefix = configuration.key_path(where) or "(top level)"
    assert message.startswith(f"config: {prefix}: unknown key 'colour' (allowed: ")


def test_long_values_are_shortened_to_one_short_line(base):
    message = error_of(broken(base, ("traces",), {"a": list(range(200))}))
    assert message.startswith("config: traces: {'a': [0, 1, 2")
    assert len(message) < 160


@pytest.mark.parametrize("path, value, expected", [
    (("spec", "num_qo_heads"), 30, "config: spec: num_qo_heads=30 is not a multiple of num_kv_heads=8"),
    (("seeds", "holdout"), [20260622, 7], "config: seeds.holdout: contains the calibration seed 20260622"),
    (("ablations", "buckets", "traces"), ["bimodal_b8", "bimodal_b9"],
     "config: ablations.buckets.traces[1]: 'bimodal_b9' is not a trace name"),
    (("ablations", "splits", "traces"), ["nope"], "config: ablations.splits.traces[0]: 'nope' is not a trace name"),
    (("measure", "gqa_sweep", "trace"), "missing", "config: measure.gqa_sweep.trace: 'missing' is not a trace name"),
    (("measure", "fragmented", "traces"), ["zipf_b9"], "config: measure.fragmented.traces[0]: 'zipf_b9'"),
    (("measure", "gqa_sweep", "group_sizes"), [1, 3], "config: measure.gqa_sweep.group_sizes[1]: 3 does not divide"),
    (("traces", 6, "path"), "config/nope.csv", "config: traces[6].path: 'config/nope.csv' does not exist"),
    (("traces", 1, "name"), "bucketed_b1", "config: traces[1].name: 'bucketed_b1' is used by an earlier trace"),
    (("ablations", "splits", "values"), [1, 2, 2], "config: ablations.splits.values: 2 is listed twice"),
])
def test_cross_field_errors(base, path, value, expected):
    assert error_of(broken(base, path, value)).startswith(expected)


def test_path_only_for_file_traces(base):
    config = copy.deepcopy(base)
    config["traces"][0]["path"] = "config/example_trace.csv"
    assert error_of(config).startswith("config: traces[0].path: only kind 'file' reads a path")


def test_load_config_file_errors(tmp_path):
    with pytest.raises(PKVError, match="config file .*nope.yaml does not exist"):
        configuration.load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec: [1, 2\nseeds: {}\n")
    with pytest.raises(PKVError, match=r"bad.yaml: line \d+, column \d+ is not valid YAML") as info:
        configuration.load_config(bad)
    assert "\n" not in str(info.value)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(PKVError, match="must be a mapping of keys, got 42"):
        configuration.load_config(scalar)


def test_trace_entry_lookup(base):
    assert configuration.trace_entry(base, "bimodal_b8")["splits"] == 20
    with pytest.raises(PKVError, match="trace 'bimodal_b9' is not in the config"):
        configuration.trace_entry(base, "bimodal_b9")


LEAVES = [("spec", "num_qo_heads"), ("spec", "page_size"), ("spec", "dtype"), ("seeds", "calibration"),
          ("seeds", "holdout"), ("hardware", "measure"), ("planner", "target_items"), ("traces", 0, "splits"),
          ("traces", 3, "num_steps"), ("traces", 6, "kind"), ("ablations", "buckets", "bucket_tokens"),
          ("validation", "cpu", "steps_per_trace"), ("measure", "gqa_sweep", "group_sizes"),
          ("measure", "backends"), ("policy", "candidates"), ("traces",), ("measure",)]
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-10, 2**33), st.floats(allow_nan=True),
                   st.text(max_size=8), st.lists(st.integers(-3, 40), max_size=4),
                   st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(leaf=st.sampled_from(LEAVES), value=VALUES)
def test_any_bad_value_is_a_one_line_config_error(base, leaf, value):
    """Whatever lands at a key, validation accepts it or says one line: never another exception."""
    config = broken(base, leaf, value)
    try:
        configuration.validate_config(config, base_dir=ROOT)
    except PKVError as exc:
        message = str(exc)
        assert message.startswith("config: ") and "\n" not in message
        return
    # Accepted: then the spec and trace entries must be usable as they are.
    configuration.spec(config)
    for name in configuration.trace_names(config):
        configuration.trace_entry(config, name)


@pytest.mark.parametrize("path, value", [(("traces", 0, "splits"), 20.0), (("planner", "target_items"), 264.0),
                                         (("seeds", "holdout"), [1.0, 2])])
def test_integers_must_be_written_as_integers(base, path, value):
    assert "is not of type 'integer'" in error_of(broken(base, path, value))


def test_workflow_config_must_match_the_file_the_commands_read(base, tmp_path):
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(base))
    configuration.check_config_file(copy.deepcopy(base), path)  # identical: fine
    for changed, where in ((broken(base, ("traces", 2, "splits"), 12), "traces[2].splits"),
                           (broken(base, ("planner", "extra"), 1), "planner.extra"),
                           (broken(base, ("seeds", "holdout"), [1, 2]), "seeds.holdout")):
        with pytest.raises(PKVError) as info:
            configuration.check_config_file(changed, path)
        assert str(info.value).startswith(f"config: {where} differs from {path}, which every command reads")


def test_string_numbers_get_a_precise_hint(base):
    assert error_of(broken(base, ("planner", "target_items"), "100")) == \
        "config: planner.target_items: '100' is a string, not an integer"
    assert error_of(broken(base, ("validation", "gpu", "rtol_float16"), "2e-3")).endswith(
        "'2e-3' is a string, not a number (YAML reads 1e-3 as text: write 1.0e-3)")
