"""The in-process comparison on the tiny zoo: both systems serve every request, CoSine's output is
the target's own, and the figures are consistent with each other. No timing assertions."""

from __future__ import annotations

import json

import pytest

from benchmarks.inprocess import main


@pytest.mark.slow
def test_cosine_in_process_serves_the_target_alone_s_output(tiny_zoo, tmp_path, capsys) -> None:
    out = tmp_path / "inprocess.json"
    rc = main(
        [
            "--zoo",
            str(tiny_zoo.root),
            "--concurrency",
            "1,3",
            "--requests",
            "5",
            "--max-new-tokens",
            "12",
            "--threads",
            "1",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["gpu"] is None
    assert report["drafters"] == sorted(tiny_zoo.drafters)
    assert [r["concurrency"] for r in report["results"]] == [1, 3]
    for r in report["results"]:
        alone, cosine = r["target_alone"], r["cosine"]
        assert r["greedy_equal"] == r["requests"] == 5 and r["mismatched"] == []
        assert alone["tokens"] == cosine["tokens"] > 0
        # the target alone commits one token a request and pass; with 1 in flight, one request a pass
        if r["concurrency"] == 1:
            assert alone["passes"] == alone["tokens"]
        assert r["speedup"] == pytest.approx(cosine["tokens_per_s"] / alone["tokens_per_s"])
    assert "speed-up" in capsys.readouterr().out


def test_bad_concurrency_is_one_clear_error(tiny_zoo) -> None:
    with pytest.raises(SystemExit, match="--concurrency"):
        main(["--zoo", str(tiny_zoo.root), "--concurrency", "0"])
    with pytest.raises(SystemExit, match="no such zoo"):
        main(["--zoo", "/nonexistent/zoo", "--concurrency", "1"])
