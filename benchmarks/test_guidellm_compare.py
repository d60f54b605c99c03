"""guidellm's report read the way the comparison prints it (guidellm itself is not installed in CI)."""

from __future__ import annotations

import json

from benchmarks.guidellm_compare import figures, parse_args, table, write_data


def report(tokens: float, duration: float, ttft: float, itl: float, ok: int) -> dict:
    def dist(**kw):
        return {"successful": kw, "errored": {}, "incomplete": {}, "total": {}}

    metrics = {
        "output_token_count": dist(total_sum=tokens),
        "time_to_first_token_ms": dist(median=ttft),
        "inter_token_latency_ms": dist(median=itl),
        "request_latency": dist(count=ok),
    }
    return {"benchmarks": [{"metrics": metrics, "duration": duration}]}


def test_throughput_is_the_output_tokens_over_the_duration_and_cosine_is_read_against_plain():
    cosine = figures(report(768, 4.0, 50.0, 4.5, 24))
    plain = figures(report(768, 8.0, 120.0, 10.0, 24))
    assert cosine == {"output_tok_s": 192.0, "ttft_ms": 50.0, "itl_ms": 4.5, "completed": 24}
    lines = table([{"cosine": cosine, "services_plain": plain}]).splitlines()
    assert lines[2] == "| 1 | cosine | 192.0 | 50 | 4.5 | 24 | 2.00 |"
    assert lines[3].endswith("| 1.00 |")


def test_the_prompts_are_the_zoos_round_robin_with_the_output_length(tiny_zoo, tmp_path):
    path = tmp_path / "prompts.jsonl"
    write_data(tiny_zoo, 6, 32, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 6 and all(r["output_tokens_count"] == 32 for r in rows)
    domains = sorted(d for d in tiny_zoo.prompts if tiny_zoo.prompts[d])
    assert rows[0]["prompt"] == tiny_zoo.prompts[domains[0]][0]
    assert rows[1]["prompt"] == tiny_zoo.prompts[domains[1]][0]
    assert parse_args([]).temperature == 0.0  # greedy unless asked
