"""bench/_report.py: each bench script rewrites only its own marked blocks of bench/README.md."""

from __future__ import annotations

from bench._report import unmarked, write_blocks

A = ("<!-- a:start -->", "<!-- a:end -->")
B = ("<!-- b:start -->", "<!-- b:end -->")


def test_write_blocks_replaces_only_its_block_when_markers_exist(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# Benchmarks\n\nprose\n{A[0]}\nold a\n{A[1]}\nmiddle\n{B[0]}\nold b\n{B[1]}\ntail\n")
    write_blocks({A: "new a\n"}, readme=readme)
    assert readme.read_text() == f"# Benchmarks\n\nprose\n{A[0]}\nnew a\n{A[1]}\nmiddle\n{B[0]}\nold b\n{B[1]}\ntail\n"


def test_write_blocks_appends_under_heading_once_when_markers_absent(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n")
    write_blocks({A: "a", B: "b"}, heading="## Section\n\nwhy", readme=readme)
    text = readme.read_text()
    assert text == f"# Benchmarks\n\n## Section\n\nwhy\n\n{A[0]}\na\n{A[1]}\n\n{B[0]}\nb\n{B[1]}\n"
    write_blocks({A: "a2"}, heading="## Section\n\nwhy", readme=readme)
    assert readme.read_text().count("## Section") == 1 and "a2" in readme.read_text()


def test_unmarked_strips_markers_when_block_was_rendered_with_them():
    assert unmarked(f"{A[0]}\nbody\n{A[1]}", *A) == "body"
