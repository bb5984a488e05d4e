"""``vitgraph info``: what is loaded (model or preset, dtype) and the buckets, wrapped."""

from vitgraph.cli import main as cli_main


def test_info_names_the_model_and_dtype_and_wraps_the_buckets(capsys):
    assert cli_main(["info", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "model: random weights of the tiny preset, dtype float32"
    start = lines.index("eager mode on cpu: no graphs; planned: 76 buckets (tokens x frames):")
    names = []
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        assert len(line) <= 100, line
        names += line.strip().rstrip(",").split(", ")
    assert len(names) == 76 and names[:3] == ["256x1", "256x16", "288x1"] and names[-1] == "16384x16"
