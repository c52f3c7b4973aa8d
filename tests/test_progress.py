"""Progress where standard error is not a terminal (CI logs, pipes): issue 21, item 5.

A line per phase with its time, a progress line of the running loop at most every 10 s and at its
end, a line at least every 10 s while anything runs; --no-progress prints none of it; on a
terminal the rich spinner and bars are drawn as before (tests/test_hardening.py). The loop
timings use a fake clock: the lines' spacing is checked, not waited for.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from qtool.phases import phase
from qtool.progress import INTERVAL_S, LineDisplay, bars, showing

STAMP = re.compile(r"^\[(\d+\.\d)s\] (.*)$")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _stamped(lines: list[str]) -> list[tuple[float, str]]:
    parsed = []
    for line in lines:
        match = STAMP.match(line)
        assert match, line
        parsed.append((float(match.group(1)), match.group(2)))
    return parsed


def test_a_loop_writes_at_most_every_interval_and_once_at_its_end() -> None:
    clock, lines = FakeClock(), []
    with showing(True, terminal=False, write=lines.append, clock=clock, ticker=False):
        with bars(True, line="calibrating: {count} samples") as bar:
            task = bar.add_task("calibrate", total=1024)
            for _ in range(64):  # 64 batches of 16 samples, 0.7 s each: 44.8 s
                clock.now += 0.7
                bar.advance(task, 16)
    stamped = _stamped(lines)
    times = [t for t, _ in stamped]
    assert all(b - a >= INTERVAL_S for a, b in zip(times[:-2], times[1:-1], strict=True)), times
    assert times[:-1] == [10.5, 21.0, 31.5, 42.0]  # the first advance past each 10 s
    assert stamped[0][1] == "calibrating: 240/1024 samples"
    assert stamped[-1] == (44.8, "calibrating: 1024/1024 samples, done in 44.8s")


def test_a_fast_loop_writes_only_its_end() -> None:
    clock, lines = FakeClock(), []
    with showing(True, terminal=False, write=lines.append, clock=clock, ticker=False):
        with bars(True, line="evaluating: {count} batches") as bar:
            task = bar.add_task("batches")  # a streamed source: no total
            for _ in range(3):
                clock.now += 1.0
                bar.advance(task)
    assert lines == ["[3.0s] evaluating: 3 batches, done in 3.0s"]


def test_phase_lines_carry_their_time_and_failed_phases_none() -> None:
    clock, lines = FakeClock(), []
    with showing(True, terminal=False, write=lines.append, clock=clock, ticker=False):
        clock.now += 0.5
        with phase("preparing graph"):
            clock.now += 3.2
        with pytest.raises(ValueError), phase("verifying what ONNX Runtime runs"):
            clock.now += 1.0
            raise ValueError("the error line that follows says what happened")
    assert lines == ["[3.7s] phase 'preparing graph' done in 3.2s"]


def test_a_loop_that_raises_writes_no_end_line() -> None:
    clock, lines = FakeClock(), []
    with showing(True, terminal=False, write=lines.append, clock=clock, ticker=False):
        with pytest.raises(KeyboardInterrupt), bars(True, line="{count}") as bar:
            bar.add_task("x", total=3)
            raise KeyboardInterrupt
    assert lines == []


def test_the_poll_names_the_running_phase_or_loop() -> None:
    clock, lines = FakeClock(), []
    display = LineDisplay(lines.append, clock)
    display.started("exporting PyTorch model")
    clock.now += 9.9
    display.poll()
    assert lines == []
    clock.now += 0.1
    display.poll()
    assert lines == ["[10.0s] exporting PyTorch model: running for 10.0s"]
    display.ended("exporting PyTorch model", ok=True)
    clock.now += 10.0
    display.poll()  # between phases, outside any loop: it still says the command is alive
    assert lines[-1] == "[20.0s] still working"
    with display.bars((), "qat epoch {epoch}/{epochs}: {count} steps, loss {loss}", False) as bar:
        task = bar.add_task("", total=10, epoch=1, epochs=2, loss="-")
        bar.update(task, advance=4, loss="0.12345")
        clock.now += 10.0
        display.poll()
    assert lines[-2] == "[30.0s] qat epoch 1/2: 4/10 steps, loss 0.12345"
    assert lines[-1] == "[30.0s] qat epoch 1/2: 4/10 steps, loss 0.12345, done in 10.0s"


def test_finished_tasks_are_not_repeated_and_each_ends_with_its_own_time() -> None:
    """QAT: one task per epoch, all kept; AdaRound: a task per layer, removed when done."""
    clock, lines = FakeClock(), []
    template = "qat epoch {epoch}/{epochs}: {count} steps, loss {loss}"
    with showing(True, terminal=False, write=lines.append, clock=clock, ticker=False):
        with bars(True, line=template, transient=False) as bar:
            for epoch in (1, 2, 3):
                task = bar.add_task("", total=4, epoch=epoch, epochs=3, loss="-")
                for step in range(4):
                    clock.now += 1.5
                    bar.update(task, advance=1, loss=f"0.{epoch}{step}")
    assert lines == [
        "[10.5s] qat epoch 2/3: 3/4 steps, loss 0.22",  # the running epoch only
        "[18.0s] qat epoch 1/3: 4/4 steps, loss 0.13, done in 6.0s",
        "[18.0s] qat epoch 2/3: 4/4 steps, loss 0.23, done in 6.0s",
        "[18.0s] qat epoch 3/3: 4/4 steps, loss 0.33, done in 6.0s",
    ]


def test_the_ticker_writes_during_a_long_phase_without_a_loop() -> None:
    """The thread that keeps a silent phase visible, on the real clock with a short interval."""
    lines: list[str] = []
    with showing(True, terminal=False, write=lines.append, interval=0.2):
        with phase("exporting PyTorch model"):
            time.sleep(0.9)
    running = [line for line in lines if "exporting PyTorch model: running for" in line]
    assert 3 <= len(running) <= 5, lines
    times = [t for t, _ in _stamped(lines)]  # stamps are rounded to 0.1 s
    assert all(b - a >= 0.15 for a, b in zip(times[:-2], times[1:-1], strict=True)), times
    assert "phase 'exporting PyTorch model' done in" in lines[-1]


def test_disabled_progress_writes_nothing() -> None:
    lines: list[str] = []
    with showing(False, terminal=False, write=lines.append, ticker=False):
        with phase("preparing graph"), bars(False, line="{count}") as bar:
            bar.advance(bar.add_task("x", total=1))
    assert lines == []


# --- the CLI, not a terminal (CliRunner) ---------------------------------------------------------


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("progress")
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("Gemm", ["x", "w1"], ["h"], name="fc1"),
            helper.make_node("Relu", ["h"], ["r"], name="relu"),
            helper.make_node("Gemm", ["r", "w2"], ["y"], name="fc2"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [
            numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "w1"),
            numpy_helper.from_array(rng.standard_normal((16, 4)).astype(np.float32), "w2"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, folder / "model.onnx")
    np.savez(folder / "data.npz", x=rng.standard_normal((40, 8)).astype(np.float32))
    data = {"npz": "data.npz"}
    path = folder / "recipe.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"onnx": "model.onnx"},
                "inputs": {"x": [1, 8]},
                "calibration": {"data": data, "batch_size": 8, "method": "minmax"},
                "evaluation": {"data": data, "batch_size": 8},
            }
        )
    )
    return path


def test_quantize_in_a_pipe_prints_its_phases_with_times(recipe, cli, tmp_path) -> None:
    result = cli("quantize", recipe, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    stamped = _stamped(result.stderr.strip().splitlines())
    texts = [text for _, text in stamped]
    assert [t.split(" done in ")[0] for t in texts] == [
        "phase 'preparing graph'",
        "phase 'calibrating: loading the model into ONNX Runtime'",
        "calibrating: 40/40 samples,",
        "phase 'verifying what ONNX Runtime runs'",
    ], texts
    assert all(re.search(r" done in \d+\.\ds$", t) for t in texts), texts
    times = [t for t, _ in stamped]
    assert times == sorted(times)
    assert "phase" not in result.stdout and "quantized" in result.stdout  # results stay apart


def test_evaluate_in_a_pipe_prints_its_loop(recipe, cli, tmp_path) -> None:
    assert cli("quantize", recipe, "-o", tmp_path, "--no-progress").exit_code == 0
    result = cli("evaluate", recipe, "-o", tmp_path, "--latency-runs", "1")
    assert result.exit_code == 0, result.output
    (line,) = result.stderr.strip().splitlines()
    # a recipe's data source streams: batches are counted without a total
    assert re.fullmatch(r"\[\d+\.\ds\] evaluating: 5 batches, done in \d+\.\ds", line), line


def test_no_progress_prints_no_progress_lines(recipe, cli, tmp_path) -> None:
    result = cli("quantize", recipe, "-o", tmp_path / "out", "--no-progress")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
