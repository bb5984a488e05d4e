"""Progress on the command line: a status line with elapsed time for phases with no count, a
bar for images encoded when there is more than one chunk of them."""

import io
import sys
import time

import pytest
from PIL import Image

from vitgraph.cli import main as cli_main
from vitgraph.cli_args import status


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def visible_lines(text: str) -> list[str]:
    """The lines a terminal shows for ``text``: each line as its last carriage return and
    erase-line left it, empty ones dropped."""
    lines = (line.rsplit("\r", 1)[-1].replace("\033[K", "") for line in text.split("\n"))
    return [line for line in lines if line]


def test_a_status_line_on_a_terminal_shows_once_the_phase_is_slow_and_says_how_long_it_took():
    term = Terminal()
    with status("building a tower", stream=term, after_s=0):
        time.sleep(0.05)
    text = term.getvalue()
    assert "\rbuilding a tower ... 0 s" in text and text.count("\n") == 1
    (line,) = visible_lines(text)
    assert line.startswith("building a tower: done in ") and line.endswith(" s")
    quick = Terminal()
    with status("building a tower", stream=quick, after_s=10):
        pass
    assert quick.getvalue() == ""  # nothing for a phase done sooner


def test_a_status_line_is_not_written_to_a_log():
    log = io.StringIO()
    with status("building a tower", stream=log, after_s=0):
        time.sleep(0.05)
    assert log.getvalue() == ""  # a line in a log could not be taken back if the phase then failed


def test_a_status_line_on_a_terminal_counts_seconds_and_is_erased_when_the_phase_fails():
    term = Terminal()
    with pytest.raises(KeyboardInterrupt):
        with status("loading Qwen/X", stream=term, after_s=0):
            time.sleep(1.3)
            raise KeyboardInterrupt
    text = term.getvalue()
    assert "\rloading Qwen/X ... 0 s" in text and "\rloading Qwen/X ... 1 s" in text
    assert "\n" not in text and text.endswith("\r\033[K") and visible_lines(text) == []


@pytest.mark.parametrize("stderr", [None, Terminal], ids=["log", "terminal"])
def test_a_load_that_fails_after_more_than_a_second_is_one_error_line(monkeypatch, capsys, stderr):
    """The README's promise on a slow machine: the progress of a long load does not come before
    the error, in a log or on a terminal."""
    from vitgraph.runtime.encoder import GraphedVisionEncoder

    def slow_then_bad(*args, **kwargs):
        time.sleep(1.3)
        raise ValueError("the weights are bad")

    monkeypatch.setattr(GraphedVisionEncoder, "from_config", slow_then_bad)
    if stderr:
        monkeypatch.setattr(sys, "stderr", stderr())
    assert cli_main(["demo", "--device", "cpu"]) == 2
    err = sys.stderr.getvalue() if stderr else capsys.readouterr().err
    assert visible_lines(err) == ["vitgraph demo: error: the weights are bad"], repr(err)
    if not stderr:
        assert err == "vitgraph demo: error: the weights are bad\n"


@pytest.mark.parametrize("count, bar", [(2, False), (17, True)])
def test_encode_shows_a_bar_for_more_than_one_chunk(tmp_path, capsys, count, bar):
    paths = []
    for i in range(count):
        paths.append(tmp_path / f"{i}.png")
        Image.new("RGB", (28 + i, 28), "blue").save(paths[-1])
    assert cli_main(["encode", *map(str, paths), "--out", str(tmp_path / "e.safetensors"), "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert ("encoding: 100%" in err and f"{count}/{count}" in err) == bar, err
