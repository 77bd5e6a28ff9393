"""`coppelius program` (SPEC 13): a backend's captured program as JSON, and
its refusals of bad input in one line."""

import json

import pytest

from coppelius.cli import main
from coppelius.reference.config import preset
from coppelius.reference.semantic import semantic_graph


def cli(argv, capsys):
    status = main(argv)
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.parametrize("backend", ["reference", pytest.param("mlx", marks=pytest.mark.mlx)])
def test_prints_the_compilation_debug_report(backend, capsys):
    if backend == "mlx":
        pytest.importorskip("mlx.core")
    status, out, err = cli(["program", "--backend", backend, "--preset", "test", "--batch", "2"],
                           capsys)
    assert status == 0 and err == ""
    doc = json.loads(out)
    assert doc["schema"] == "coppelius.training_compilation.v2"
    assert (doc["backend"], doc["batch"], doc["precision"]) == (backend, 2, "fp32")
    assert doc["name"] == f"test B=2 fp32 on {backend}"
    assert len(doc["stages"]) == 11 and doc["dnn_plan"]["partition_count"] == 11
    assert doc["memory_analysis"]["resource_count"] > 0


def test_semantic_graph_and_executable_plan(capsys):
    argv = ["program", "--backend", "reference", "--preset", "test", "--precision", "bf16"]
    status, out, _ = cli(argv + ["--semantic"], capsys)
    assert status == 0
    assert out == semantic_graph(preset("test"), 1, "bf16").debug_report_json(
        "test B=1 bf16 on reference")
    status, out, _ = cli(argv + ["--plan"], capsys)
    doc = json.loads(out)
    assert status == 0 and doc["schema"] == "coppelius.executable_plan.v1"
    assert doc["node_count"] == len(semantic_graph(preset("test"), 1, "bf16").operations)


@pytest.mark.parametrize("argv, words", [
    (["--backend", "nonesuch", "--preset", "test"], ["nonesuch", "reference"]),
    (["--backend", "reference", "--preset", "huge"], ["huge", "tiny"]),
    (["--backend", "reference", "--preset", "test", "--batch", "0"], ["--batch=0"]),
], ids=["backend", "preset", "batch"])
def test_bad_input_is_one_line_and_status_2(argv, words, capsys):
    status, out, err = cli(["program", *argv], capsys)
    assert status == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("coppelius program: error: ")
    for word in words:
        assert word in err
