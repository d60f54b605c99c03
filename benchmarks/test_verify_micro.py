"""verify_micro's ``--op-count`` line: the paged pass's count is one number at every batch size,
today's grows with the batch."""

import re

from benchmarks.verify_micro import main


def test_op_count_line(capsys) -> None:
    main(["--op-count", "--hidden", "64", "--layers", "1", "--vocab", "256", "--context", "24", "--threads", "1"])
    out = capsys.readouterr().out
    paged = re.search(r"^ops per pass: B=1 (\d+), B=8 (\d+), B=32 (\d+)$", out, re.M)
    today = re.search(r"^contiguous: ops per pass: B=1 (\d+), B=8 (\d+), B=32 (\d+)$", out, re.M)
    assert paged and today, out
    assert len(set(paged.groups())) == 1
    assert int(today.group(3)) > int(today.group(1))
