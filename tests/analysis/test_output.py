import io
import subprocess
import sys
from pathlib import Path

import pytest

from rank_lightning.analysis.output import fresh_directory, fresh_file, print_written, progress_bar, show_progress

ROOT = Path(__file__).resolve().parents[2]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_missing_or_empty_folder_is_used_as_it_is(tmp_path):
    assert fresh_directory(tmp_path / "new" / "out") == tmp_path / "new" / "out"
    assert not (tmp_path / "new").exists(), "the writer creates the folder, not the choice"
    (tmp_path / "empty").mkdir()
    assert fresh_directory(tmp_path / "empty") == tmp_path / "empty"


def test_a_folder_with_files_gets_the_next_free_numbered_subfolder(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "summary.csv").write_text("first run")
    assert fresh_directory(tmp_path / "out") == tmp_path / "out" / "run_2"
    (tmp_path / "out" / "run_2").mkdir()
    (tmp_path / "out" / "run_3").mkdir()
    assert fresh_directory(tmp_path / "out") == tmp_path / "out" / "run_4"


def test_a_file_is_no_output_folder(tmp_path):
    (tmp_path / "taken").write_text("")
    with pytest.raises(NotADirectoryError, match=r"output folder '.*taken' is an existing file"):
        fresh_directory(tmp_path / "taken")


def test_a_folder_below_a_file_cannot_be_created(tmp_path):
    (tmp_path / "taken").write_text("")
    with pytest.raises(NotADirectoryError, match=r"cannot create '.*taken/out': '.*taken' is an existing file"):
        fresh_directory(tmp_path / "taken" / "out")
    with pytest.raises(NotADirectoryError, match=r"'.*taken' is an existing file"):
        fresh_file(tmp_path / "taken" / "figure.png")


def test_an_existing_file_gets_the_next_free_numbered_name_beside_it(tmp_path):
    target = tmp_path / "runs" / "theorem5.png"
    assert fresh_file(target) == target
    assert not (tmp_path / "runs").exists(), "the writer creates the folder, not the choice"
    target.parent.mkdir()
    target.write_bytes(b"first")
    assert fresh_file(target) == tmp_path / "runs" / "theorem5_2.png"
    (tmp_path / "runs" / "theorem5_2.png").write_bytes(b"second")
    assert fresh_file(target) == tmp_path / "runs" / "theorem5_3.png"
    with pytest.raises(IsADirectoryError, match=r"output file '.*runs' is an existing folder"):
        fresh_file(tmp_path / "runs")


def test_the_readme_numbers_later_runs_as_the_tools_do(tmp_path):
    section = (ROOT / "README.md").read_text().split("\n## Comparing runs\n", 1)[1].split("\n## ", 1)[0]
    text = " ".join(section.split())
    assert "the second report goes to `run_2`" in text and "the third to `run_3`" in text
    assert "`theorem5_2.png`" in text
    out = tmp_path / "report"
    out.mkdir()
    (out / "summary.csv").write_text("first report")
    assert fresh_directory(out) == out / "run_2"
    (out / "run_2").mkdir()
    assert fresh_directory(out) == out / "run_3"
    (tmp_path / "theorem5.png").write_bytes(b"first figure")
    assert fresh_file(tmp_path / "theorem5.png").name == "theorem5_2.png"


def test_progress_is_drawn_only_on_a_terminal():
    assert show_progress(False, _Terminal())
    assert not show_progress(True, _Terminal())
    assert not show_progress(False, io.StringIO())
    for enabled in (True, False):
        stream = _Terminal()
        with progress_bar(enabled, stream) as progress:
            list(progress.track(range(3), description="counting"))
        assert ("counting" in stream.getvalue()) is enabled


def test_a_disabled_bar_adds_nothing_to_what_is_printed_through_its_console():
    # Piped or quiet, the bar draws nothing, not even the empty line rich 13.0 prints when a progress stops on a
    # console that is not a terminal; lines printed through its console still reach the stream.
    stream = io.StringIO()
    with progress_bar(False, stream) as progress:
        progress.advance(progress.add_task("counting", total=2))
        progress.console.print("[1/2] done   weight_decay=0/version_0 in 3 s")
    assert stream.getvalue() == "[1/2] done   weight_decay=0/version_0 in 3 s\n"


def test_a_terminal_that_cannot_redraw_gets_no_bar_and_no_empty_line(monkeypatch):
    # TERM=dumb (an editor's shell, some CI consoles): rich draws no live bar there, only an empty line when it stops.
    monkeypatch.setenv("TERM", "dumb")
    monkeypatch.delenv("TTY_INTERACTIVE", raising=False)
    stream = _Terminal()
    with progress_bar(True, stream) as progress:
        list(progress.track(range(3), description="counting"))
        progress.console.print("[1/2] done   weight_decay=0/version_0 in 3 s")
    assert stream.getvalue() == "[1/2] done   weight_decay=0/version_0 in 3 s\n"


def test_the_summary_names_the_folder_and_shortens_long_lists(tmp_path, capsys):
    figures = [tmp_path / "run_2" / f"figure_{i}.png" for i in range(9)]
    tables = [tmp_path / "run_2" / "summary.csv"]
    print_written(tmp_path / "run_2", {"figures": figures, "tables": tables, "logs": []}, requested=tmp_path)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"written to {tmp_path / 'run_2'} ({tmp_path} already held a run's files):",
        "    9 figures  figure_0.png, ..., figure_8.png",
        "    1 tables   summary.csv",
    ]


def test_the_summary_of_a_numbered_file_names_the_file_that_existed(tmp_path, capsys):
    requested, written = tmp_path / "theorem5.png", tmp_path / "theorem5_2.png"
    print_written(tmp_path, {"figure": [written]}, requested=requested)
    assert capsys.readouterr().out.splitlines()[0] == f"written to {tmp_path} ({requested} already existed):"
    print_written(tmp_path, {"figure": [requested]}, requested=requested)
    assert capsys.readouterr().out.splitlines()[0] == f"written to {tmp_path}:"


def test_the_summary_of_the_requested_folder_has_no_note(tmp_path, capsys):
    print_written(tmp_path, {"files": [Path(tmp_path / "a.png")]}, requested=str(tmp_path))
    assert capsys.readouterr().out.splitlines()[0] == f"written to {tmp_path}:"


def test_folders_of_one_name_are_told_apart_by_their_parent(tmp_path, capsys):
    # A sweep's run folders are all version_0: the summary read "version_0, ..., version_0".
    runs = [tmp_path / f"weight_decay={d}" / "version_0" for d in ("0", "0.01", "0.1")]
    print_written(tmp_path, {"run folders": runs}, requested=tmp_path)
    assert capsys.readouterr().out.splitlines()[1] == (
        "    3 run folders  weight_decay=0/version_0, weight_decay=0.01/version_0, weight_decay=0.1/version_0"
    )


@pytest.mark.parametrize("command", ["rank_lightning.analysis.theorem5", "rank_lightning.reproduce"])
def test_a_reader_that_stops_early_ends_the_command_quietly(command: str, tmp_path: Path) -> None:
    # `... | head` ended with a BrokenPipeError traceback (and "Exception ignored ... <stdout>") on the terminal.
    arguments = ["--width", "8", "--depth", "3", "--seeds", "1", "--out", str(tmp_path / "t5.png")]
    arguments = arguments if command.endswith("theorem5") else ["--list"]
    process = subprocess.Popen(
        [sys.executable, "-m", command, *arguments], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path
    )
    process.stdout.close()  # the reader is gone before the command writes its first line
    errors = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141, errors
    assert "BrokenPipeError" not in errors and "Traceback" not in errors, errors
