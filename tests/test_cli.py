"""The CPU commands (info, traces, counters, validate-cpu, ablation) through ``persistentkv``:
help, bad input as one line with exit status 2, byte-identical traces, and interrupted writes that
leave nothing behind."""

from __future__ import annotations

import json
import pathlib
from pathlib import Path

import pandas as pd
import pytest
import yaml

from persistentkv import cli, configuration
from persistentkv.commands import ablation
from persistentkv.render import figures

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config" / "config.yaml"
SEED = configuration.calibration_seed(configuration.load_config(CONFIG, base_dir=ROOT))
CPU_COMMANDS = ("info", "traces", "counters", "validate-cpu", "ablation")


def run(argv, capsys) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line_error(code: int, err: str) -> str:
    """The single stderr line of a user error (exit 2)."""
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err.strip()


def write_config(tmp_path: Path, edit) -> Path:
    config = yaml.safe_load(CONFIG.read_text())
    config["traces"][6]["path"] = str(ROOT / "config" / "example_trace.csv")
    edit(config)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("command", CPU_COMMANDS)
def test_help(command, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: persistentkv {command}")
    if command != "info":
        assert "--config" in out and "--out" in out
    assert "info" in cli.COMMANDS and all(c in cli.COMMANDS for c in CPU_COMMANDS)


# ---- bad input: one line naming the value, exit 2 ---------------------------------------------

@pytest.mark.parametrize("edit, expected", [
    (lambda c: c["spec"].update(colour="blue"), "error: config: spec: unknown key 'colour'"),
    (lambda c: c["planner"].update(target_items="many"), "error: config: planner.target_items: 'many' is not of type 'integer'"),
    (lambda c: c["spec"].update(page_size=24), "error: config: spec.page_size: 24 is not one of"),
    (lambda c: c["spec"].update(num_qo_heads=12), "error: config: spec: num_qo_heads=12 is not a multiple of num_kv_heads=8"),
    (lambda c: c["seeds"].update(calibration=2**32), "error: config: seeds.calibration: 4294967296 is greater than the maximum"),
])
def test_bad_config_through_every_command(tmp_path, capsys, edit, expected):
    config = write_config(tmp_path, edit)
    trace_json = tmp_path / "t.json"
    trace_json.write_text("{}")
    for argv in (["traces", "--config", config, "--trace", "bimodal_b8", "--out", tmp_path / "x.json"],
                 ["counters", "--config", config, "--trace-json", trace_json, "--out", tmp_path / "x.parquet"],
                 ["validate-cpu", "--config", config, "--out", tmp_path / "v.parquet"],
                 ["ablation", "buckets", "--config", config, "--out", tmp_path / "a.parquet"],
                 ["info", "--config", config]):
        code, _, err = run(argv, capsys)
        assert one_line_error(code, err).startswith(expected), argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "t.json"]


@pytest.mark.parametrize("csv, expected", [
    ("request_id,arrival_step,prompt_len,decode_steps\n0,0,0,4\n", "prompt_len must be >= 1, got 0"),
    ("request_id,arrival_step,prompt_len,decode_steps\n0,0,-5,4\n", "prompt_len must be >= 1, got -5"),
    ("request_id,arrival_step,prompt_len,decode_steps\n0,0,100,0\n", "decode_steps must be >= 1, got 0"),
    ("request_id,arrival_step,prompt_len\n0,0,100\n", "missing column(s) decode_steps"),
    ("request_id,arrival_step,prompt_len,decode_steps\n0,0,1e3,4\n", "column prompt_len must be an integer, got '1e3'"),
    ("request_id,arrival_step,prompt_len,decode_steps\n0,zero,100,4\n", "column arrival_step must be an integer, got 'zero'"),
])
def test_bad_trace_files(tmp_path, capsys, csv, expected):
    path = tmp_path / "mine.csv"
    path.write_text(csv)
    code, _, err = run(["traces", "--file", path, "--max-active", 2, "--out", tmp_path / "t.json"], capsys)
    assert expected in one_line_error(code, err)
    assert str(path) in err
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("argv, expected", [
    (["--trace", "bimodal_b8", "--seed", -1], "error: seed=-1 is out of range [0, 4294965269]"),
    (["--trace", "bimodal_b8", "--seed", 2**32], "error: seed=4294967296 is out of range [0, 4294965269]"),
    (["--trace", "bimodal_b9"], "error: trace 'bimodal_b9' is not in the config"),
    (["--trace", "bimodal_b8", "--max-active", 4], "error: --max-active applies to --file only"),
    (["--file", ROOT / "config" / "example_trace.csv"], "error: --file needs --max-active"),
    (["--file", ROOT / "config" / "example_trace.csv", "--max-active", 0], "error: max_active must be >= 1, got 0"),
    (["--file", ROOT / "config" / "nope.csv", "--max-active", 2], "does not exist"),
])
def test_bad_trace_arguments(tmp_path, capsys, argv, expected):
    code, _, err = run(["traces", "--config", CONFIG, "--out", tmp_path / "t.json", *argv], capsys)
    assert expected in one_line_error(code, err)
    assert not (tmp_path / "t.json").exists()


def test_counters_bad_inputs(tmp_path, capsys):
    code, _, err = run(["counters", "--config", CONFIG, "--trace-json", tmp_path / "none.json",
                        "--out", tmp_path / "c.parquet"], capsys)
    assert "none.json does not exist" in one_line_error(code, err)
    junk = tmp_path / "junk.json"
    junk.write_text("not json")
    code, _, err = run(["counters", "--config", CONFIG, "--trace-json", junk, "--out", tmp_path / "c.parquet"], capsys)
    assert "not a persistentkv trace file" in one_line_error(code, err)
    mine = tmp_path / "mine.json"
    run(["traces", "--file", ROOT / "config" / "example_trace.csv", "--max-active", 2, "--name", "mine",
         "--out", mine], capsys)
    code, _, err = run(["counters", "--config", CONFIG, "--trace-json", mine, "--out", tmp_path / "c.parquet"], capsys)
    assert "trace 'mine'" in one_line_error(code, err) and "pass --splits" in err
    code, _, err = run(["counters", "--config", CONFIG, "--trace-json", mine, "--splits", 0,
                        "--out", tmp_path / "c.parquet"], capsys)
    assert "--splits must be >= 1, got 0" in one_line_error(code, err)
    assert not (tmp_path / "c.parquet").exists()


# ---- traces: same seed, same bytes --------------------------------------------------------------

def test_traces_are_byte_identical_for_the_same_seed(tmp_path, capsys):
    outs = []
    for index, seed in enumerate((SEED, SEED, SEED + 1)):
        out = tmp_path / f"t{index}.json"
        code, stdout, err = run(["traces", "--config", CONFIG, "--trace", "zipf_b8", "--seed", seed, "--out", out],
                                capsys)
        assert code == 0, err
        assert f"seed {seed}" in stdout
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    assert outs[0] != outs[2]
    data = json.loads(outs[0])
    assert data["format"] == "persistentkv-trace/1" and data["name"] == "zipf_b8" and data["seed"] == SEED
    assert len(data["steps"]) == 48


def test_file_trace_defaults(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, stdout, err = run(["traces", "--file", ROOT / "config" / "example_trace.csv", "--max-active", 4,
                             "--num-steps", 10], capsys)
    assert code == 0, err
    out = tmp_path / "build" / "traces" / "example_trace_s0.json"
    data = json.loads(out.read_text())
    assert data["kind"] == "file" and data["max_active"] == 4 and len(data["steps"]) == 10
    assert data["requests"][0] == [0, 0, 3000, 40]


# ---- counters and ablations end to end ----------------------------------------------------------

def test_counters_command(tmp_path, capsys):
    trace_json = tmp_path / f"bucketed_b1_s{SEED}.json"
    run(["traces", "--config", CONFIG, "--trace", "bucketed_b1", "--out", trace_json], capsys)
    out = tmp_path / "c.parquet"
    code, stdout, err = run(["counters", "--config", CONFIG, "--trace-json", trace_json, "--out", out,
                             "--no-progress"], capsys)
    assert code == 0, err
    frame = pd.read_parquet(out)
    assert len(frame) == 4 * 64 and (frame["batch_size"] == 1).all()
    assert set(frame.loc[frame["route"] == "buckets", "launches"]) == {2}  # one length per step, S = 32
    assert "256 rows" in stdout


def small_ablation_config(tmp_path: Path) -> Path:
    def edit(config):
        config["ablations"]["buckets"]["traces"] = ["bimodal_b4", "example_file"]
        config["ablations"]["splits"] = {"traces": ["bimodal_b4"], "values": [1, 4, 16]}
    return write_config(tmp_path, edit)


@pytest.mark.parametrize("kind", ["buckets", "splits"])
def test_ablation_command(tmp_path, capsys, kind):
    config = small_ablation_config(tmp_path)
    for name in ("bimodal_b4", "example_file"):
        code, _, err = run(["traces", "--config", config, "--trace", name, "--out",
                            tmp_path / "traces" / f"{name}_s{SEED}.json"], capsys)
        assert code == 0, err
    out, figure = tmp_path / f"ablation_{kind}.parquet", tmp_path / f"ablation_{kind}.svg"
    code, _, err = run(["ablation", kind, "--config", config, "--traces-dir", tmp_path / "traces", "--out", out,
                        "--figure", figure, "--no-progress"], capsys)
    assert code == 0, err
    frame = pd.read_parquet(out)
    assert figure.read_text().lstrip().startswith("<?xml") and "</svg>" in figure.read_text()
    assert "<dc:date>" not in figure.read_text()  # the renderers' writer: a rerun writes the same bytes
    if kind == "buckets":
        assert tuple(frame.columns) == ablation.BUCKET_COLUMNS
        assert list(dict.fromkeys(frame["variant"])) == ["exact", "padded_2048", "padded_8192", "padded_32768",
                                                         "workqueue", "split_rect"]
        exact = frame[frame["variant"] == "exact"]
        assert (exact["num_splits"] == 32).all() and (exact["padded_kv_bytes"] == 0).all()
        rect = frame[(frame["variant"] == "split_rect") & (frame["trace"] == "bimodal_b4")]
        assert (rect["num_splits"] == 20).all() and (rect["launches"] == 2).all()
        padded = frame[frame["variant"] == "padded_32768"]
        assert (padded["padded_kv_bytes"] > 0).all() and (padded["bucket_tokens"] == 32768).all()
        for column in ("launches", "padded_kv_bytes", "merge_state_bytes", "paper_merge_state_bytes"):
            assert column in frame.columns  # docs/DATA.md
    else:
        assert tuple(frame.columns) == ablation.SPLIT_COLUMNS
        fixed = frame[frame["num_splits"] > 0]
        assert set(fixed["num_splits"]) == {1, 4, 16} and set(fixed["route"]) == {"split", "buckets", "workqueue_fixed"}
        assert set(frame.loc[frame["num_splits"] < 0, "route"]) == {"workqueue"}
        s1 = fixed[fixed["num_splits"] == 1]
        assert (s1["merge_state_bytes"] == 0).all()  # one split: nothing to merge


def test_ablation_rejects_a_bad_figure_name(tmp_path, capsys):
    code, _, err = run(["ablation", "splits", "--config", CONFIG, "--out", tmp_path / "a.parquet",
                        "--figure", tmp_path / "a.gif"], capsys)
    assert "the extension must be one of .svg, .pdf, .png" in one_line_error(code, err)


def test_info(capsys):
    code, out, err = run(["info"], capsys)
    assert code == 0, err
    assert out.startswith("persistentkv ") and "GPU: " in out and "backends" in out
    code, out, _ = run(["info", "--json"], capsys)
    info = json.loads(out)
    assert set(info) >= {"python", "packages", "gpu", "spec", "backends"}
    assert info["spec"]["num_qo_heads"] == 32
    if isinstance(info["backends"], dict):
        assert info["backends"].get("numpy") == []  # the CPU executor runs anywhere


# ---- interrupted runs leave no output -----------------------------------------------------------

class Interrupted(Exception):
    pass


def test_interrupted_parquet_write_leaves_nothing(tmp_path, capsys, monkeypatch):
    trace_json = tmp_path / f"bucketed_b1_s{SEED}.json"
    run(["traces", "--config", CONFIG, "--trace", "bucketed_b1", "--out", trace_json], capsys)
    real = pd.DataFrame.to_parquet

    def killed(self, path, *args, **kwargs):
        real(self.head(3), path, *args, **kwargs)  # part of the file is on disk ...
        raise Interrupted("killed mid-write")      # ... when the process dies

    monkeypatch.setattr(pd.DataFrame, "to_parquet", killed)
    out = tmp_path / "out" / "c.parquet"
    with pytest.raises(Interrupted):
        cli.main(["counters", "--config", str(CONFIG), "--trace-json", str(trace_json), "--out", str(out),
                  "--no-progress"])
    assert list(out.parent.iterdir()) == []  # neither the output nor a temporary file


def test_interrupted_trace_write_leaves_nothing(tmp_path, monkeypatch):
    real = pathlib.Path.write_text

    def killed(self, data, *args, **kwargs):
        real(self, data[: len(data) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(pathlib.Path, "write_text", killed)
    out = tmp_path / "out" / "t.json"
    assert cli.main(["traces", "--config", str(CONFIG), "--trace", "bimodal_b8", "--out", str(out)]) == 130
    assert list(out.parent.iterdir()) == []


def test_interrupted_figure_leaves_no_table(tmp_path, capsys, monkeypatch):
    config = small_ablation_config(tmp_path)
    run(["traces", "--config", config, "--trace", "bimodal_b4", "--out",
         tmp_path / "traces" / f"bimodal_b4_s{SEED}.json"], capsys)

    def killed(frame):
        raise Interrupted("killed while drawing")

    monkeypatch.setattr(figures, "fig_split_ablation", killed)
    out = tmp_path / "res" / "ablation_splits.parquet"
    with pytest.raises(Interrupted):
        cli.main(["ablation", "splits", "--config", str(config), "--traces-dir", str(tmp_path / "traces"),
                  "--out", str(out), "--figure", str(tmp_path / "res" / "ablation_splits.svg"), "--no-progress"])
    assert not out.parent.exists() or list(out.parent.iterdir()) == []
