"""The benchmark harness: workloads, metrics, ratios, the greedy token check, and a quick run on
the tiny zoo that writes a report following the schema, plus its plots. No timing assertions."""

from __future__ import annotations

import json
import os
import random
from dataclasses import replace

import pytest

from benchmarks.bench import BenchOptions, run_bench
from benchmarks.cpu_split import PARTS
from benchmarks.greedy_check import GreedyMismatch, check_greedy
from benchmarks.plots import PLOTS, _style
from benchmarks.records import RequestRecord
from benchmarks.report import HEADLINE, SCHEMA, compute_ratios, percentile, validate_report
from benchmarks.systems import ALL_SYSTEMS, AutoregressiveSystem, make_systems
from benchmarks.workloads import WorkloadSpec, build_workload, poisson_arrivals


def test_poisson_arrivals_follow_the_rate_of_each_phase():
    rng = random.Random(0)
    steady = poisson_arrivals([50.0], 0.0, 5000, rng)
    assert steady == sorted(steady)
    assert 45 < len(steady) / steady[-1] < 55
    # two phases of 1 s: 10/s then 90/s; count arrivals per phase over many cycles
    times = poisson_arrivals([10.0, 90.0], 1.0, 20000, random.Random(1))
    low = sum(1 for t in times if int(t) % 2 == 0)
    high = len(times) - low
    assert 7 < high / low < 11
    # phase lengths that are not exact in binary floating point (0.1 s) must not stall the clock
    odd = poisson_arrivals([3.0, 30.0], 0.1, 2000, random.Random(2))
    assert odd == sorted(odd) and 10 < len(odd) / odd[-1] < 23


def test_workloads_share_prompts_and_scale_rates_with_the_reference():
    items = [("code", f"p{i}", (1, 2, i)) for i in range(5)]
    closed = build_workload(WorkloadSpec("c", "closed", 7, concurrency=2), items, 16)
    opened = build_workload(WorkloadSpec("o", "open", 7, load=2.0), items, 16, reference_rps=3.0)
    assert [r.prompt_ids for r in closed.requests] == [r.prompt_ids for r in opened.requests]
    assert all(r.arrival_s == 0 for r in closed.requests)
    assert opened.offered_rps == pytest.approx(6.0)
    assert [r.arrival_s for r in opened.requests] == sorted(r.arrival_s for r in opened.requests)
    sampled = build_workload(WorkloadSpec("s", "closed", 3, temperature=0.8), items, 16)
    assert all(r.seed is not None and r.temperature == 0.8 for r in sampled.requests)
    with pytest.raises(ValueError):
        build_workload(WorkloadSpec("o", "open", 3, load=1.0), items, 16)


def test_percentile_and_ratios():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    systems = {
        "cosine": {
            "hi": {"tokens_per_s": 300.0, "latency_mean_s": 1.0},
            "lo": {"tokens_per_s": 50.0, "latency_mean_s": 0.5},
        },
        "vanilla_sd": {
            "hi": {"tokens_per_s": 200.0, "latency_mean_s": 2.0},
            "lo": {"tokens_per_s": 50.0, "latency_mean_s": 1.0},
        },
    }
    r = compute_ratios(systems, {"high": "hi", "low": "lo"})
    assert r["cosine_vs_vanilla_sd_throughput"] == pytest.approx(1.5)
    assert r["cosine_vs_vanilla_sd_latency"] == pytest.approx(0.5)
    assert r["cosine_vs_hf_assisted_throughput"] is None  # not measured in this run: no ratio
    assert r["by_workload"]["hi"]["cosine_vs_vanilla_sd_throughput"] == pytest.approx(1.5)


def test_sustained_throughput_counts_the_tokens_emitted_while_every_client_was_busy():
    from benchmarks.report import sustained_tokens_per_s

    spec = WorkloadSpec("c2", "closed", 3, concurrency=2)
    wl = build_workload(spec, [("d", "p", (1, 2))] * 3, 5)
    # two clients: requests 0 and 1 issued at 0; request 2 issued at 4 s when request 0 finished; the
    # window is [0, 4]: request 0 whole (5 tokens), request 1 (first token at 1 s, last of 9 at 9 s)
    # half-way through its remaining 8 (1 + 8 * 3/8 = 4), request 2 nothing yet (first token at 5 s)
    recs = [
        RequestRecord(0, "d", tuple(range(5)), issued_s=0.0, first_token_s=1.0, finished_s=4.0),
        RequestRecord(1, "d", tuple(range(9)), issued_s=0.0, first_token_s=1.0, finished_s=9.0),
        RequestRecord(2, "d", tuple(range(3)), issued_s=4.0, first_token_s=5.0, finished_s=7.0),
    ]
    assert sustained_tokens_per_s(recs, wl) == pytest.approx((5 + 4) / 4.0)
    # not defined for an open loop, for one client, or when every request was issued at once
    open_wl = build_workload(WorkloadSpec("o", "open", 3, load=1.0), [("d", "p", (1, 2))] * 3, 5, reference_rps=1.0)
    assert sustained_tokens_per_s(recs, open_wl) is None
    one = build_workload(WorkloadSpec("c1", "closed", 3, concurrency=1), [("d", "p", (1, 2))] * 3, 5)
    assert sustained_tokens_per_s(recs, one) is None
    assert sustained_tokens_per_s([RequestRecord(0, "d", (1,), 0.0, 0.5, 1.0)], wl) is None
    # and the ratio between two systems appears beside the whole-run one
    per = {
        "a": {"c2": {"tokens_per_s": 2.0, "sustained_tokens_per_s": 3.0, "latency_mean_s": 1.0}},
        "autoregressive": {"c2": {"tokens_per_s": 4.0, "sustained_tokens_per_s": 3.0, "latency_mean_s": 1.0}},
    }
    row = compute_ratios(per, {})["by_workload"]["c2"]
    assert row["a_vs_autoregressive_throughput"] == pytest.approx(0.5) and row[
        "a_vs_autoregressive_sustained"
    ] == pytest.approx(1.0)


def test_greedy_check_names_the_first_divergence():
    expected = {(1, 2): (5, 6, 7, 8)}
    good = RequestRecord(0, "code", token_ids=(5, 6, 7, 8))
    bad = RequestRecord(1, "prose", token_ids=(5, 6, 9, 8))
    short = RequestRecord(2, "code", token_ids=(5, 6))
    out = check_greedy("x", "w", [good, bad, short], expected, {0: (1, 2), 1: (1, 2), 2: (1, 2)})
    assert [(m["request"], m["position"]) for m in out] == [(1, 2), (2, 2)]


class _Corrupting(AutoregressiveSystem):
    """The autoregressive system with one output token changed: a lossless system gone wrong."""

    def run(self, workload):
        result = super().run(workload)
        rec = result.records[-1]
        if rec.token_ids:
            rec.token_ids = (*rec.token_ids[:-1], rec.token_ids[-1] + 1)
        return result


def test_a_greedy_mismatch_fails_the_benchmark_loudly(tiny_zoo, tmp_path):
    def factory(names, zoo, eos_id, pad_id, cores, log_dir, threads):
        return [_Corrupting(str(zoo.target.path), eos_id, 1, name="broken")], None

    out = tmp_path / "report.json"
    opts = BenchOptions(
        zoo=str(tiny_zoo.root),
        out=str(out),
        scenario="quick",
        workloads=["closed_c4"],
        cores=1,
        plots=False,
        progress=False,
    )
    with pytest.raises(GreedyMismatch, match="GREEDY OUTPUT MISMATCH.*broken.*closed_c4"):
        run_bench(opts, system_factory=factory)
    report = json.loads(out.read_text())  # what was measured is still written, with the mismatch
    assert report["scenario"]["complete"] is False
    (m,) = report["scenario"]["greedy_check"]["mismatches"]
    assert m["system"] == "broken" and m["workload"] == "closed_c4" and m["request"] == 3
    assert m["position"] == m["got_len"] - 1 and m["got"][-1] == m["expected"][-1] + 1


class _Logged(AutoregressiveSystem):
    """The autoregressive system, writing (workload, system) into ``log`` for every measured run."""

    def __init__(self, log, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = log

    def run(self, workload):
        if workload.name != "warm-up":
            self.log.append((workload.name, self.name))
        return super().run(workload)


def test_every_system_runs_a_workload_before_any_runs_the_next(tiny_zoo, tmp_path):
    log = []

    def factory(names, zoo, eos_id, pad_id, cores, log_dir, threads):
        return [_Logged(log, str(zoo.target.path), eos_id, 1, name=n) for n in ("first", "second")], None

    opts = BenchOptions(
        zoo=str(tiny_zoo.root),
        out=str(tmp_path / "report.json"),
        scenario="quick",
        cores=1,
        plots=False,
        progress=False,
        max_new_tokens=2,
        requests=2,
        workloads=["closed_c1", "closed_c4", "open_high"],
    )
    report = run_bench(opts, system_factory=factory)
    # the machine drifts over minutes: the figures a ratio compares are measured next to each other
    assert log == [(w, s) for w in ("closed_c1", "closed_c4", "open_high") for s in ("first", "second")]
    assert report["scenario"]["order"] == ["first", "second"]


class _OneAtATime(AutoregressiveSystem):
    """The autoregressive system declared as serving one request at a time, like transformers' generate."""

    one_at_a_time = True


@pytest.mark.parametrize("serial_first", [False, True])
def test_a_one_at_a_time_system_runs_only_the_unloaded_workloads(tiny_zoo, tmp_path, serial_first):
    def factory(names, zoo, eos_id, pad_id, cores, log_dir, threads):
        plain = AutoregressiveSystem(str(zoo.target.path), eos_id, 1, name="plain")
        serial = _OneAtATime(str(zoo.target.path), eos_id, 1, name="serial")
        return ([serial, plain] if serial_first else [plain, serial]), None

    out = tmp_path / "report.json"
    opts = BenchOptions(
        zoo=str(tiny_zoo.root), out=str(out), scenario="quick", cores=1, plots=False, progress=False, max_new_tokens=4
    )
    report = run_bench(opts, system_factory=factory)
    every = {"closed_c1", "closed_c4", "open_low", "open_high", "closed_c4_sampling"}
    assert set(report["systems"]["plain"]) == every
    # the first system measures the capacity the open-loop rates come from (closed_c4 here), whatever it is
    ran = {"closed_c1", "open_low"} | ({"closed_c4"} if serial_first else set())
    assert set(report["systems"]["serial"]) == ran
    assert set(report["scenario"]["skipped"]["serial"]["workloads"]) == every - ran
    assert "plain" not in report["scenario"]["skipped"]
    # a workload it skipped has no ratio against it, and the summary shows a dash, not a zero
    assert "plain_vs_serial_throughput" not in report["ratios"]["by_workload"]["open_high"]
    from benchmarks.summary import systems_table

    row = next(line for line in systems_table(report).splitlines() if line.startswith("| serial |"))
    assert "| - | - |" in row and "0%" not in row
    # named workloads run as asked, loaded or not
    opts = BenchOptions(
        zoo=str(tiny_zoo.root),
        out=str(out),
        scenario="quick",
        cores=1,
        plots=False,
        progress=False,
        max_new_tokens=4,
        workloads=["closed_c4"],
    )
    assert set(run_bench(opts, system_factory=factory)["systems"]["serial"]) == {"closed_c4"}


@pytest.mark.slow
def test_quick_scenario_writes_a_report_following_the_schema_and_plots(tiny_zoo, tmp_path):
    out = tmp_path / "bench" / "report.json"
    # cosine's router is the service plane's own; services_plain gets a second router and gateway
    opts = BenchOptions(
        zoo=str(tiny_zoo.root),
        out=str(out),
        scenario="quick",
        systems=["cosine", "autoregressive", "hf_assisted", "services_plain"],
        workloads=["closed_c4", "open_low", "open_high"],
        cores=2,
        progress=False,
    )
    report = run_bench(opts, system_factory=make_systems)
    on_disk = json.loads(out.read_text())
    assert on_disk["schema"] == SCHEMA and validate_report(on_disk) == []
    assert on_disk["scenario"]["complete"] is True
    assert set(on_disk["systems"]) == {"cosine", "autoregressive", "hf_assisted", "services_plain"}
    # each service system's counters are its own router's: drafting off in one, on in the other (in
    # workloads this short cosine's yield guard may run them all as plain epochs, which it counts and
    # services_plain never does; that the drafts themselves are verified losslessly through the
    # services is the dtype test's, with the guard off)
    for w in ("closed_c4", "open_low", "open_high"):
        plain, cos = on_disk["systems"]["services_plain"][w]["counters"], on_disk["systems"]["cosine"][w]["counters"]
        assert plain["draft_tokens"] == 0 and plain["accepted_tokens"] == 0 and plain["guard_plain_rounds"] == 0
        assert cos["draft_tokens"] > 0 or cos["guard_plain_rounds"] > 0, cos
        assert (
            plain["verify_batches"] > 0
            and plain["tokens_committed"] == on_disk["systems"]["services_plain"][w]["output_tokens"]
        )
        # every part of the serving path is metered, the verifier worked, and together they used no
        # more than the machine has (the kernel counts in ticks of 10 ms: the tiny zoo's router may
        # show none in a run this short)
        for name in ("services_plain", "cosine"):
            m = on_disk["systems"][name][w]
            cpu = {k: v for k, v in m["counters"].items() if k.startswith("cpu_s_")}
            assert set(cpu) == {f"cpu_s_{p}" for p in PARTS} and cpu["cpu_s_verifier"] > 0, cpu
            assert sum(cpu.values()) <= (os.cpu_count() or 1) * (m["wall_s"] + 2.0), cpu
        assert not any(k.startswith("cpu_s_") for k in on_disk["systems"]["autoregressive"][w]["counters"])
    for per in on_disk["systems"].values():
        assert set(per) == {"closed_c4", "open_low", "open_high"}
        for m in per.values():
            assert m["failed"] == 0 and m["output_tokens"] > 0
    checked = on_disk["scenario"]["greedy_check"]
    assert checked["mismatches"] == [] and checked["checked_requests"] == 4 * (4 + 3 + 4)
    # every headline ratio is the quotient of two figures of this same report (or null when a side is absent)
    s, r = on_disk["systems"], on_disk["ratios"]
    for key, a, b, metric, role in HEADLINE:
        w = r["workloads"].get(role)  # the quick scenario has no 16-client workload
        if a in s and b in s and w in s[a] and w in s[b]:
            assert r[key] == pytest.approx(s[a][w][metric] / s[b][w][metric]), key
        else:  # a system or a workload this run did not measure: no ratio
            assert r[key] is None, key
    assert r["cosine_vs_autoregressive_throughput"] is not None and r["cosine_vs_hf_assisted_throughput"] is not None
    # drafts were accepted, unless the yield guard ran plain epochs through this short workload
    high = s["cosine"]["open_high"]
    assert high["mean_accepted_len"] > 0 or high["counters"]["guard_plain_rounds"] > 0, high["counters"]
    for name in PLOTS:
        png = out.parent / name
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the Markdown summary shows every system of the run and the goal ratios of this report
    from benchmarks.summary import goals_table, systems_table

    table = systems_table(on_disk)
    assert all(f"| {name} |" in table for name in on_disk["scenario"]["order"])
    goals = goals_table(on_disk)
    want = r["cosine_vs_autoregressive_throughput"]
    assert f"| cosine / autoregressive, tokens/s, high load | {want:.2f} | >= 1.3 |" in goals
    assert report["ratios"] == on_disk["ratios"]


def test_cli_registers_bench():
    from cosine_cli.main import build_parser

    args = build_parser().parse_args(["bench", "--scenario", "quick", "--systems", "cosine,vanilla_sd"])
    assert args.func.__name__ == "cmd_bench" and args.systems == "cosine,vanilla_sd"


def test_every_system_has_a_line_of_its_own_in_the_plots():
    """Two systems drawn alike read as one in a legend: colour and marker tell each apart."""
    looks = [_style(name)[:2] for name in ALL_SYSTEMS]
    assert len(set(looks)) == len(ALL_SYSTEMS)
    assert len({color for color, _ in looks}) == len(ALL_SYSTEMS)


def test_every_system_runs_the_target_in_the_dtype_asked(tiny_zoo, tmp_path):
    from common.runtime.runner import resolve_dtype

    systems, plane = make_systems(
        ["autoregressive", "hf_assisted", "cosine"], tiny_zoo, None, None, 1, str(tmp_path), dtype="auto"
    )
    want = resolve_dtype("auto", "cpu")
    assert [s.dtype for s in systems[:2]] == [want, want]
    assert systems[1].exact_greedy is (want == "float32")  # transformers' bfloat16 kernels round by the shape of a pass
    assert plane is not None and plane.cluster.spec.verifier_args == ("--dtype", "auto", "--device", "cpu")
    assert plane.cluster.spec.drafter_args == ("--device", "cpu")
    systems, _ = make_systems(["hf_generate"], tiny_zoo, None, None, 1, str(tmp_path))
    assert systems[0].dtype == "float32" and systems[0].exact_greedy


def test_every_system_puts_its_models_on_the_device_asked(tiny_zoo, tmp_path):
    """(Nothing is loaded here: the processes and engines start only in ``start``.)"""
    systems, plane = make_systems(
        ["autoregressive", "cosine"], tiny_zoo, None, None, 1, str(tmp_path), dtype="bfloat16", device="cuda:1"
    )
    assert systems[0].device == "cuda:1" and systems[0].describe()["device"] == "cuda:1"
    assert plane is not None and plane.cluster.spec.verifier_args == ("--dtype", "bfloat16", "--device", "cuda:1")
    assert plane.cluster.spec.drafter_args == ("--device", "cuda:1")
    with pytest.raises(ValueError, match="transformers' systems run on the CPU only"):
        make_systems(["hf_assisted"], tiny_zoo, None, None, 1, str(tmp_path), device="cuda")


def test_the_services_in_the_dtype_auto_give_the_target_alones_greedy_outputs(tiny_zoo, tmp_path):
    """Where the CPU has AMX this is the row-invariant bfloat16 through real services: every greedy
    output of cosine equals the in-process target alone's in the same dtype (the bench fails on one
    that does not). Without the yield guard, whose plain epochs could leave a workload this short
    with nothing speculated to check."""
    opts = BenchOptions(
        zoo=str(tiny_zoo.root),
        out=str(tmp_path / "report.json"),
        scenario="quick",
        cores=2,
        plots=False,
        progress=False,
        max_new_tokens=8,
        systems=["autoregressive", "cosine_no_guard"],
        workloads=["closed_c4"],
        dtype="auto",
    )
    report = run_bench(opts)
    from common.runtime.runner import resolve_dtype

    assert report["scenario"]["target_dtype"] == resolve_dtype("auto", "cpu")
    assert (
        report["scenario"]["greedy_check"]["checked_requests"] > 0
        and not report["scenario"]["greedy_check"]["mismatches"]
    )
    assert report["systems"]["cosine_no_guard"]["closed_c4"]["counters"]["accepted_tokens"] > 0


def test_an_ablation_runs_only_where_its_headline_ratios_are_read(tiny_zoo, tmp_path):
    # named like cosine's ablations: cosine_no_corpus is read at one client and high load
    # (report.HEADLINE); cosine_one_drafter has no headline ratio, so it runs everything
    def factory(names, zoo, eos_id, pad_id, cores, log_dir, threads):
        return [
            AutoregressiveSystem(str(zoo.target.path), eos_id, 1, name=n)
            for n in ("cosine", "cosine_no_corpus", "cosine_one_drafter")
        ], None

    every = {"closed_c1", "closed_c4", "open_low", "open_high", "closed_c4_sampling"}
    opts = BenchOptions(
        zoo=str(tiny_zoo.root),
        out=str(tmp_path / "report.json"),
        scenario="quick",
        cores=1,
        plots=False,
        progress=False,
        max_new_tokens=2,
        requests=2,
    )
    report = run_bench(opts, system_factory=factory)
    assert set(report["systems"]["cosine"]) == every
    assert set(report["systems"]["cosine_no_corpus"]) == {"closed_c1", "open_high"}
    assert set(report["systems"]["cosine_one_drafter"]) == every
    skipped = report["scenario"]["skipped"]
    assert set(skipped) == {"cosine_no_corpus"} and set(skipped["cosine_no_corpus"]["workloads"]) == every - {
        "closed_c1",
        "open_high",
    }
    assert "ablation" in skipped["cosine_no_corpus"]["why"]
    assert report["ratios"]["cosine_vs_cosine_no_corpus_throughput_c1"] is not None
    assert report["ratios"]["cosine_vs_cosine_no_corpus_throughput"] is not None

    # workloads named: run as asked
    opts = replace(opts, out=str(tmp_path / "named.json"), workloads=["closed_c4"])
    report = run_bench(opts, system_factory=factory)
    assert set(report["systems"]["cosine_no_corpus"]) == {"closed_c4"} and report["scenario"]["skipped"] == {}
