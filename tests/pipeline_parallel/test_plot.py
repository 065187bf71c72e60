"""The schedule picture draws every pass of the executed table, where the table times it."""

from __future__ import annotations

import pytest

from tpcore.pipeline_parallel.plot import main, plot_schedule
from tpcore.pipeline_parallel.schedule_table import schedule_table


@pytest.mark.parametrize(
    "schedule,p,m,v", [("gpipe", 2, 3, 1), ("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2)]
)
def test_every_pass_is_drawn_where_the_table_runs_it(tmp_path, schedule, p, m, v):
    table = schedule_table(p, m, v, schedule)
    path = tmp_path / "schedule.svg"
    boxes = plot_schedule(table, str(path))
    assert path.stat().st_size > 0
    assert len(boxes) == p * v * m * 2  # a forward and a backward per micro-batch and chunk
    for rank in range(p):
        drawn = [(start, width, label) for r, start, width, label in boxes if r == rank]
        want = [
            (start, 1.0 if a.kind == "F" else 2.0, f"{a.micro}" + (f".{a.chunk}" if v > 1 else ""))
            for a, start in zip(table.actions[rank], table.starts[rank])
        ]
        assert drawn == want
        for (s0, w0, _), (s1, _, _) in zip(drawn, drawn[1:]):
            assert s1 >= s0 + w0, f"rank {rank}: passes overlap"


def test_command_line(tmp_path, capsys):
    out = tmp_path / "pp.png"
    assert main(["--schedule", "interleaved", "-p", "4", "-m", "8", "--output", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert "bubble 0.188" in capsys.readouterr().out  # (p - 1) / (v m) = 3 / 16
    with pytest.raises(SystemExit):
        main(["--schedule", "interleaved", "-p", "4", "-m", "6", "--output", str(out)])
    assert "multiple of the pipeline size" in capsys.readouterr().err
