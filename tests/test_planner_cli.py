"""``dynpipe plan``: output table and file, slowdowns, memory errors, predictor input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dynpipe.cli import main
from dynpipe.models import get_model
from dynpipe.planner.plan import Plan

MLP = ["--model", "mlp", "--set", "depth=10", "--set", "width=256"]


def test_plan_prints_a_table_and_writes_a_valid_plan(tmp_path, capsys) -> None:
    out = tmp_path / "mlp-3.json"
    assert (
        main(["plan", *MLP, "--stages", "3", "--batch-size", "48", "--compare", "-o", str(out)])
        == 0
    )
    text = capsys.readouterr().out
    assert "fwd ms" in text and "memory" in text and "<- bottleneck" in text
    assert "step " in text and "bubble" in text and "analytic roofline" in text
    assert "parameters" in text and "even" in text  # the comparison rows
    plan = Plan.load(out)
    model = get_model("mlp", depth=10, width=256)
    plan.validate(model, world_size=3)
    assert plan.microbatches == 6 and plan.meta["batch_size"] == 48
    assert plan.meta["costs"]["microbatch_size"] == 8 and plan.meta["method"] == "dp"
    assert all(st.fwd_ms > 0 and st.mem_bytes > 0 for st in plan.stages)


def test_slowdown_moves_layers_off_the_slow_device(capsys) -> None:
    def sizes(*extra: str) -> list[int]:
        assert main(["plan", *MLP, "--stages", "2", "--json", *extra]) == 0
        plan = Plan.from_json(capsys.readouterr().out)
        return [len(st) for st in plan.stages]

    clean = sizes()
    slow = sizes("--slowdown", "1,3")
    assert slow[1] < clean[1]
    assert sizes("--slowdown", "1:3") == slow


def test_memory_too_small_is_one_line_with_exit_2(capsys) -> None:
    assert main(["plan", *MLP, "--stages", "2", "--memory-gb", "0.0001"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "does not fit 2 stages" in err and "raise --memory-gb to" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--stages", "20"], "--stages 20: mlp has 12 layers"),
        (["--stages", "2", "--batch-size", "10", "--microbatches", "4"], "does not split into 4"),
        (["--stages", "2", "--slowdown", "1,2,3"], "3 factors for 2 stages"),
        (["--stages", "2", "--memory-gb", "1,2,3"], "3 values for 2 stages"),
        (["--stages", "2", "--predictor", "x.json"], "needs --telemetry"),
        (["--stages", "2", "--conditions", "none"], "needs --profile"),
        (["--stages", "2", "--migration-ms-per-gb", "5"], "give --current"),
        (["--stages", "2", "--bf16", "--dtype", "float16"], "give one of them"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, message, capsys) -> None:
    assert main(["plan", *MLP, *argv]) == 2
    assert message in capsys.readouterr().err


def test_bf16_counts_float32_weights(capsys) -> None:
    """``--bf16`` (autocast) runs layers in bfloat16 but keeps float32 weights, gradients and
    optimizer state: the same times as ``--dtype bfloat16``, twice its parameter bytes (and
    so a memory limit that a bfloat16 model fits and the autocast run does not)."""

    def plan(*extra: str) -> Plan:
        assert main(["plan", *MLP, "--stages", "1", "--json", *extra]) == 0
        return Plan.from_json(capsys.readouterr().out)

    half, auto = plan("--dtype", "bfloat16"), plan("--bf16")
    assert auto.stages[0].fwd_ms == pytest.approx(half.stages[0].fwd_ms)
    assert auto.meta["costs"]["weights_dtype"] == "float32"
    assert "weights_dtype" not in half.meta["costs"]
    # AdamW: weights, gradients and two moments, each twice as wide.
    params = sum(
        p.numel() for p in get_model("mlp", depth=10, width=256).build_sequential().parameters()
    )
    extra = auto.stages[0].mem_bytes - half.stages[0].mem_bytes
    assert extra == pytest.approx(4 * 2 * params, rel=1e-6)
    limit = (half.stages[0].mem_bytes + auto.stages[0].mem_bytes) / 2 / 2**30
    assert (
        main(["plan", *MLP, "--stages", "1", "--dtype", "bfloat16", "--memory-gb", f"{limit}"]) == 0
    )
    capsys.readouterr()
    assert main(["plan", *MLP, "--stages", "1", "--bf16", "--memory-gb", f"{limit}"]) == 2
    assert "does not fit" in capsys.readouterr().err


def test_profile_and_predictor_inputs(tmp_path, capsys) -> None:
    from test_planner_costs import profile_frame

    from dynpipe.predictor import fit_predictor, save_predictor
    from dynpipe.predictor.synthetic import synthetic_profiles

    # A measured profile: device 1 under a condition measured 2x slower.
    prof = tmp_path / "toy.parquet"
    from dynpipe.profiler.schema import read_metadata, write_profiles

    model = get_model("mlp", depth=1)  # inp, fc00, head: 3 layers like the toy frame
    df = profile_frame(model="mlp")
    df["layer"] = df["layer_index"].map(dict(enumerate(model.layer_names)))
    write_profiles(
        df,
        prof,
        meta={
            "device_name": "Test GPU",
            "device_type": "cuda",
            "driver": "x",
            "torch_version": "x",
            "date": "x",
            "command": "test",
        },
    )
    assert (
        main(
            [
                "plan",
                "--model",
                "mlp",
                "--set",
                "depth=1",
                "--stages",
                "2",
                "--batch-size",
                "32",
                "--profile",
                str(prof),
                "--conditions",
                "none,gemm@0.5x2",
                "--json",
            ]
        )
        == 0
    )
    plan = Plan.from_json(capsys.readouterr().out)
    assert plan.meta["costs"]["source"] == "profile"
    assert plan.meta["costs"]["conditions"] == ["none", "gemm@0.5x2"]
    assert plan.stages[1].fwd_ms == pytest.approx(2.0 * 3)  # head alone, measured 2x slower

    # A profile of another configuration of the model is refused, naming what differs.
    args = ["plan", "--model", "mlp", "--stages", "2", "--batch-size", "32", "--profile"]
    assert main([*args, str(prof), "--set", "depth=3"]) == 2
    assert "profile's mlp has 3 layers (inp..head), the model 5" in capsys.readouterr().err
    counts = [sum(p.numel() for p in model.build_layer(i).parameters()) for i in range(3)]
    df["param_count"] = df["layer_index"].map(dict(enumerate(counts)))
    df.loc[df["layer_index"] == 1, "param_count"] += 1
    other = tmp_path / "other.parquet"
    write_profiles(df, other, meta=dict(read_metadata(prof)))
    assert main([*args, str(other), "--set", "depth=1"]) == 2
    err = capsys.readouterr().err
    assert f"layer fc00 has {counts[1] + 1} parameters, the model's {counts[1]}" in err

    # A learned predictor: a busy device 1 must get less work than a quiet one.
    data = synthetic_profiles(models=("mlp_a",), seed=0)
    pred = fit_predictor(data, estimator="ridge")
    path = save_predictor(pred, tmp_path / "p.json")
    none = data[data["condition"] == "none"].iloc[0]  # a quiet device's telemetry
    quiet = {k: float(none[k]) for k in pred.schema.telemetry}
    busy = {**quiet, "tel_other_util": 95.0, "tel_other_procs": 2.0, "tel_other_mem_util": 60.0}
    loads = {}
    for name, windows in (("quiet", [quiet, quiet]), ("busy", [quiet, busy])):
        tel = tmp_path / f"{name}.json"
        tel.write_text(json.dumps(windows))
        assert (
            main(
                [
                    "plan",
                    *MLP,
                    "--stages",
                    "2",
                    "--predictor",
                    str(path),
                    "--telemetry",
                    str(tel),
                    "--json",
                ]
            )
            == 0
        )
        plan = Plan.from_json(capsys.readouterr().out)
        assert plan.meta["costs"]["source"] == "analytic+predictor"
        loads[name] = len(plan.stages[1])
    assert loads["busy"] < loads["quiet"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([quiet]))
    assert (
        main(["plan", *MLP, "--stages", "2", "--predictor", str(path), "--telemetry", str(bad)])
        == 2
    )
    assert "1 window(s) for 2 stages" in capsys.readouterr().err


def test_current_plan_and_migration_price(tmp_path, capsys) -> None:
    cur = tmp_path / "cur.json"
    assert main(["plan", *MLP, "--stages", "2", "-o", str(cur)]) == 0
    capsys.readouterr()
    assert (
        main(
            [
                "plan",
                *MLP,
                "--stages",
                "2",
                "--slowdown",
                "1,1.2",
                "--current",
                str(cur),
                "--migration-ms-per-gb",
                "1e9",
                "--json",
            ]
        )
        == 0
    )
    plan = Plan.from_json(capsys.readouterr().out)
    assert plan.bounds == Plan.load(cur).bounds and plan.meta["migration_bytes"] == 0


def test_replace_section_keeps_the_prose_around_it(tmp_path) -> None:
    from dynpipe.planner.report import replace_section

    path = tmp_path / "README.md"
    path.write_text("intro\n<!-- t:begin -->\nold\n<!-- t:end -->\noutro\n")
    replace_section(path, "t", "new table")
    assert path.read_text() == "intro\n<!-- t:begin -->\nnew table\n<!-- t:end -->\noutro\n"
    replace_section(path, "other", "x")
    assert path.read_text().endswith("<!-- other:begin -->\nx\n<!-- other:end -->\n")


def test_package_exports_resolve_lazily() -> None:
    import dynpipe.planner as planner

    for name in planner.__all__:
        assert getattr(planner, name) is not None
    with pytest.raises(AttributeError):
        _ = planner.nothing_here


def test_help_names_a_json_predictor_and_files_the_repo_has(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = capsys.readouterr().out
    assert "--predictor JSON" in text and "JOBLIB" not in text
    root = Path(__file__).resolve().parents[1]
    # Inputs the examples read must be files a checkout has; -o names outputs.
    inputs = re.findall(r"(?<!-o )\b((?:profiles|predictor|partitions)/[\w./-]+)", text)
    assert {"profiles/h200-bs32.parquet", "predictor/h200.json.gz"} <= set(inputs)
    assert [p for p in inputs if not (root / p).is_file()] == []
