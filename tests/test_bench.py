"""The benchmark runs end to end at a tiny size and prints every row (no timing is asserted)."""

import json

from deriv_lm.bench import decoder
from deriv_lm.cli import main


TINY_ARGS = [
    "--layers",
    "1",
    "--hidden",
    "32",
    "--heads",
    "2",
    "--context",
    "32",
    "--vocab",
    "64",
    "--batch",
    "2",
    "--train-steps",
    "1",
    "--prompt",
    "4",
    "--new-tokens",
    "4",
    "--gen-repeats",
    "1",
]


def test_bench_prints_the_side_by_side_table(tmp_path, capsys):
    assert main(["bench", *TINY_ARGS, "--no-memory", "--json", str(tmp_path / "b.json")]) == 0
    table = capsys.readouterr().out
    for row in ("train tokens/s", "model FLOP utilisation", "batch 1 (greedy)", "batch 8 (greedy)"):
        assert row in table
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert all(r["deriv"] > 0 and r["gpt2"] > 0 for r in rows)


def test_peak_memory_child_reports_a_positive_size():
    parser = decoder.argparse.ArgumentParser()
    decoder.add_arguments(parser)
    args = parser.parse_args(TINY_ARGS)
    assert decoder.peak_memory_mib("deriv", 1, args) > 0
