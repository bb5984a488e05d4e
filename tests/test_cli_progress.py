"""Progress on the command line: a status line with elapsed time for phases with no count, a
bar for images encoded when there is more than one chunk of them."""

import io
import time

import pytest
from PIL import Image

from vitgraph.cli import main as cli_main
from vitgraph.cli_args import status


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_status_line_shows_once_the_phase_is_slow_and_says_how_long_it_took():
    log = io.StringIO()
    with status("building a tower", stream=log, after_s=0):
        time.sleep(0.05)
    first, last = log.getvalue().splitlines()
    assert first == "building a tower ..." and last.startswith("building a tower: done in ") and last.endswith(" s")
    quick = io.StringIO()
    with status("building a tower", stream=quick, after_s=10):
        pass
    assert quick.getvalue() == ""  # nothing for a phase done sooner (an early error stays one line)


def test_a_status_line_on_a_terminal_counts_seconds_and_says_when_it_stopped():
    term = Terminal()
    with pytest.raises(KeyboardInterrupt):
        with status("loading Qwen/X", stream=term, after_s=0):
            time.sleep(1.3)
            raise KeyboardInterrupt
    text = term.getvalue()
    assert "\rloading Qwen/X ... 0 s" in text and "\rloading Qwen/X ... 1 s" in text
    assert text.count("\n") == 1 and text.endswith("s\n") and "\rloading Qwen/X: stopped after 1." in text


@pytest.mark.parametrize("count, bar", [(2, False), (17, True)])
def test_encode_shows_a_bar_for_more_than_one_chunk(tmp_path, capsys, count, bar):
    paths = []
    for i in range(count):
        paths.append(tmp_path / f"{i}.png")
        Image.new("RGB", (28 + i, 28), "blue").save(paths[-1])
    assert cli_main(["encode", *map(str, paths), "--out", str(tmp_path / "e.safetensors"), "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert ("encoding: 100%" in err and f"{count}/{count}" in err) == bar, err
