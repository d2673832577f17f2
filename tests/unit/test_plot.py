"""``shardtune plot OUTPUT_DIR``: a PNG of loss, val_loss, lr and grad_norm from metrics.jsonl; garbage
files refused naming the file, cut or malformed lines skipped and counted, matplotlib's absence
named with the install command."""

from __future__ import annotations

import json
import sys

import pytest

from shardtune import cli
from shardtune.plot import read_series

ROWS = [
    {"step": 1, "epoch": 0, "loss": 3.0, "lr": 0.001, "grad_norm": 5.0},
    {"step": 2, "epoch": 0, "loss": 2.5, "lr": 0.002, "grad_norm": None, "val_loss": 2.75},
    {"step": 3, "epoch": 0, "loss": 2.0, "lr": 0.002, "grad_norm": 4.0},
]


def _write(path, lines: list[bytes]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))


def _json(row) -> bytes:
    return json.dumps(row).encode()


def test_plot_writes_a_png_of_the_run(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    _write(tmp_path / "run", [_json(r) for r in ROWS])
    assert cli.main(["plot", str(tmp_path / "run")]) == 0
    png = tmp_path / "run" / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert capsys.readouterr().out == f"wrote {png}\n"
    assert cli.main(["plot", str(tmp_path / "run"), "--out", str(tmp_path / "a" / "b.png")]) == 0
    assert (tmp_path / "a" / "b.png").read_bytes()[:4] == b"\x89PNG"


def test_the_columns_are_read_as_written_with_null_as_a_gap(tmp_path):
    _write(tmp_path, [_json(r) for r in ROWS])
    series = read_series(tmp_path / "metrics.jsonl")
    assert series.columns == {
        "loss": [(1, 3.0), (2, 2.5), (3, 2.0)],
        "val_loss": [(2, 2.75)],
        "lr": [(1, 0.001), (2, 0.002), (3, 0.002)],
        "grad_norm": [(1, 5.0), (2, None), (3, 4.0)],
    }
    assert series.skipped == 0


def test_no_metrics_file_is_refused_naming_it(tmp_path, capsys):
    assert cli.main(["plot", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert (
        err
        == f"shardtune plot: {tmp_path / 'metrics.jsonl'}: no such file; pass the output_dir of a run (it holds metrics.jsonl)\n"
    )
    assert not (tmp_path / "metrics.png").exists()


@pytest.mark.parametrize(
    "lines",
    [[], [b""], [b'{"step": 1, "epoch": 0}'], [b"not json", b"[1, 2]"], [b'{"step": 1, "loss": null}']],
    ids=["empty", "blank", "no plotted column", "garbage only", "only null"],
)
def test_a_file_with_nothing_to_plot_is_refused_naming_it(tmp_path, capsys, lines):
    _write(tmp_path, lines)
    assert cli.main(["plot", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"shardtune plot: {tmp_path / 'metrics.jsonl'}: no row with loss, val_loss, lr, grad_norm")
    assert not (tmp_path / "metrics.png").exists()


def test_malformed_lines_are_skipped_and_counted_naming_the_first(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    lines = [
        _json(ROWS[0]),
        b"\xff\xfe not utf-8",
        _json(ROWS[1]),
        b'{"loss": 1.0}',  # no step
        b'{"step": 1e400, "loss": 1.0}',  # a step that is no integer
        b'["step", 3]',
        _json(ROWS[2]),
        b'{"step": 4, "loss": 1.',  # cut by a kill
    ]
    _write(tmp_path, lines)
    assert read_series(tmp_path / "metrics.jsonl").columns["loss"] == [(1, 3.0), (2, 2.5), (3, 2.0)]
    assert cli.main(["plot", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert (
        err
        == f"shardtune plot: skipped 5 line(s) of {tmp_path / 'metrics.jsonl'} that are not a metrics row (first: line 2)\n"
    )


def test_without_matplotlib_the_error_names_the_extra(tmp_path, capsys, monkeypatch):
    _write(tmp_path, [_json(r) for r in ROWS])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert cli.main(["plot", str(tmp_path)]) == 1
    assert capsys.readouterr().err == "shardtune plot: plotting needs matplotlib: pip install shardtune[plot]\n"


def test_plot_needs_no_torch(tmp_path):
    """As ``shardtune verify``: torch (and transformers) unimportable, the PNG is still written."""
    import os
    import subprocess
    from pathlib import Path

    pytest.importorskip("matplotlib")
    _write(tmp_path, [_json(r) for r in ROWS])
    code = (
        "import sys\n"
        "class _Refuse:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'transformers'):\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, _Refuse())\n"
        "from shardtune.cli import main\n"
        "sys.exit(main(['plot', sys.argv[1]]))\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "metrics.png").read_bytes()[:4] == b"\x89PNG"
