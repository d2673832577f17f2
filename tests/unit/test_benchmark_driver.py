"""The benchmark driver's command line, method order and BENCHMARKS.md section writing."""

from __future__ import annotations

from pathlib import Path

from benchmarks._driver import Options, parse_run_options, rotated, write_markdown_section

BEGIN, END = "<!-- x:begin -->", "<!-- x:end -->"


def test_section_is_replaced_in_place_and_the_rest_kept(tmp_path: Path):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text(f"# title\n\n{BEGIN}\nold\n{END}\n\n<!-- y:begin -->\nother\n<!-- y:end -->\n")
    write_markdown_section(md, "new\nlines", begin=BEGIN, end=END)
    assert md.read_text() == f"# title\n\n{BEGIN}\nnew\nlines\n{END}\n\n<!-- y:begin -->\nother\n<!-- y:end -->\n"


def test_missing_section_is_appended(tmp_path: Path):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# title\n")
    write_markdown_section(md, "body", begin=BEGIN, end=END)
    assert md.read_text() == f"# title\n\n{BEGIN}\nbody\n{END}\n"


def test_each_repeat_starts_one_method_later():
    methods = ["a", "b", "c"]
    assert [rotated(methods, k) for k in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]
    assert rotated([], 2) == []


def test_smoke_means_tiny_one_repeat_short_timeout_and_no_markdown(tmp_path: Path):
    args = ["--smoke", "--size", "1b", "--repeats", "5", "--bench-dir", str(tmp_path)]
    _, common = parse_run_options(
        args, module="benchmarks.x", description="x", groups=("g1", "g2"), cold_help="", smoke_help=""
    )
    options = Options(**common)
    assert (options.size, options.repeats, options.timeout_s, options.markdown) == ("tiny", 1, 120.0, None)
    assert options.groups == ("g1", "g2")
    assert options.command == "python -m benchmarks.x " + " ".join(args)
