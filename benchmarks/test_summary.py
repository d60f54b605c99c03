"""The per-workload table of `benchmarks.summary`: every cell is a quotient of two figures of the
same report, a dash where a system did not run a workload."""

from __future__ import annotations

import pytest

from benchmarks.summary import guard_table, main, workload_table


def _m(tokens_per_s: float, latency_s: float, batches: int, busy_s: float | None = None, **extra) -> dict:
    m = {
        "tokens_per_s": tokens_per_s,
        "latency_mean_s": latency_s,
        "verify_batches": batches,
        "wall_s": 10.0,
        "verifier_busy_frac": 0.9,
        "mean_batch_requests": 2.0,
        "mean_accepted_len": 0.5,
        **extra,
    }
    if busy_s is not None:
        m["counters"] = {"verifier_busy_s": busy_s}
    return m


def _report() -> dict:
    return {
        "scenario": {
            "name": "t",
            "wall_s": 1.0,
            "zoo": {"profile": "tiny"},
            "order": ["autoregressive", "cosine"],
            "workloads": {"open_high": {}, "closed_c1": {}, "closed_c4": {}},
            "greedy_check": {"checked_requests": 3, "mismatches": []},
        },
        "systems": {
            "autoregressive": {
                "closed_c1": _m(20.0, 2.0, 100),
                "open_high": _m(100.0, 4.0, 50),
                "closed_c4": _m(50.0, 3.0, 80, sustained_tokens_per_s=55.0),
            },
            "cosine": {
                "closed_c1": _m(30.0, 1.5, 60, busy_s=3.0),
                "open_high": _m(125.0, 5.0, 40, busy_s=8.0),
                "closed_c4": _m(60.0, 2.5, 70, busy_s=7.0, sustained_tokens_per_s=66.0),
            },
        },
        "ratios": {"workloads": {"c1": "closed_c1", "high": "open_high", "low": ""}, "by_workload": {}},
    }


def test_workload_rows_follow_the_workloads_order_and_divide_figures_of_the_report():
    rows = workload_table(_report()).splitlines()[2:]
    assert [r.split(" | ")[0] for r in rows] == ["| 1 client", "| 4 clients", "| high load"]
    one = rows[0].strip("| ").split(" | ")
    assert one[1] == "1.50" and one[2] == "-" and one[3] == "0.75"  # 30/20; no sustained figure; 1.5/2.0 latency
    assert one[4:10] == ["-"] * 6  # systems this report did not run
    assert one[-1] == "50 / 90"  # cosine: 3.0 s busy over 60 passes; in process: 10 s x 0.9 over 100
    four = rows[1].strip("| ").split(" | ")
    assert four[2] == "1.20"  # sustained 66 / 55
    high = rows[2].strip("| ").split(" | ")
    assert high[1] == "1.25" and high[-1] == "200 / 180"


def test_main_prints_every_table_and_explains_itself(tmp_path, capsys):
    import json

    path = tmp_path / "report.json"
    path.write_text(json.dumps(_report()))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "greedy outputs checked: 3, mismatches: 0" in out and "| high load | 1.25 |" in out
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0 and "report.json" in capsys.readouterr().out


def test_cores_table_divides_each_parts_cpu_seconds_by_the_runs_wall_time():
    from benchmarks.summary import cores_table

    report = _report()
    report["systems"]["cosine"]["open_high"]["counters"].update(
        cpu_s_verifier=18.0, cpu_s_drafters=0.2, cpu_s_router=0.4, cpu_s_gateway=0.5, cpu_s_clients=0.3, cpu_s_redis=0.1
    )
    table = cores_table(report).splitlines()
    # the in-process system has no such counters: only cosine's high-load row (wall 10 s)
    assert table[-1] == "| cosine | high load | 1.80 | 0.02 | 0.04 | 0.05 | 0.03 | 0.01 | 1.95 |"
    assert len([r for r in table if r.startswith("| cosine") or r.startswith("| autoregressive")]) == 1
    assert cores_table(_report()) == ""  # no run with the counters: no table


def test_the_guard_table_shows_cosine_s_plain_share_its_flips_and_both_systems_tokens_per_busy_second():
    report = _report()
    report["scenario"]["order"].append("services_plain")
    guard = {"router_rounds": 200, "guard_plain_rounds": 30, "guard_withdrawals": 2, "guard_readmissions": 1}
    report["systems"]["cosine"]["open_high"]["counters"].update(guard)
    report["systems"]["cosine"]["open_high"]["bound_tokens_per_s"] = 240.0
    report["systems"]["services_plain"] = {"open_high": _m(100.0, 4.0, 50, bound_tokens_per_s=260.0)}
    rows = guard_table(report).splitlines()[4:]
    assert rows == ["| high load | 15% | 2 / 1 | 240 / 260 |"]  # only the workload with the guard's counters
    assert guard_table(_report()) == ""
