"""The continuous-batching benchmark's ratios against a reference arm cut by its time limit, and its
time to first token over every request, censored where a cut run stopped before a first token."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
from bench_scripts import load_script


def _mode(tok_s: float, in_flight: int, ttft: float, at_most: float | None = None) -> dict:
    out = {
        "mode": "burst",
        "output_tokens_per_s": tok_s,
        "max_in_flight": in_flight,
        "ttft_median_s": ttft,
    }
    if at_most is not None:
        out["output_tokens_per_s_at_most"] = at_most
    return out


def test_a_cut_reference_bounds_the_tokens_per_second_ratio_from_below() -> None:
    bench = load_script("continuous_batching")
    rows = [
        {"arm": "sdpa", "modes": [_mode(60.0, 100, 10.0, at_most=400.0)]},
        {"arm": "kvquant", "modes": [_mode(1600.0, 190, 12.0)]},
    ]
    got = bench.ratios(rows)["kvquant/burst"]
    assert got["tokens_per_s_x"] == pytest.approx(1600.0 / 60.0)
    assert got["tokens_per_s_x_at_least"] == pytest.approx(4.0)


def test_a_complete_reference_gives_no_bound() -> None:
    bench = load_script("continuous_batching")
    rows = [
        {"arm": "sdpa", "modes": [_mode(600.0, 100, 1.0)]},
        {"arm": "kvquant", "modes": [_mode(900.0, 190, 1.0)]},
    ]
    assert "tokens_per_s_x_at_least" not in bench.ratios(rows)["kvquant/burst"]


def test_a_cut_reference_bounds_the_ttft_ratio_from_above() -> None:
    bench = load_script("continuous_batching")
    ref = {**_mode(60.0, 100, 0.0), "ttft_finished_only_median_s": 15.0}
    del ref["ttft_median_s"]
    ref["ttft_median_s_at_least"] = 40.0
    mine = {**_mode(1600.0, 190, 20.0), "ttft_finished_only_median_s": 19.0}
    got = bench.ratios([{"arm": "sdpa", "modes": [ref]}, {"arm": "kvquant", "modes": [mine]}])
    got = got["kvquant/burst"]
    assert got["ttft_median_x_at_most"] == pytest.approx(0.5)
    assert "ttft_median_x" not in got
    assert got["ttft_finished_only_median_x"] == pytest.approx(19.0 / 15.0)


# Time to first token over every request, censored at the stop of a cut run.


def test_order_statistic_exact_when_every_bound_lies_above_it() -> None:
    bench = load_script("continuous_batching")
    observed, bounds = [3.0, 1.0, 2.0], [5.0, 4.0]
    assert bench.order_statistic(observed, bounds, 1) == (1.0, True)
    assert bench.order_statistic(observed, bounds, 3) == (3.0, True)
    # the 4th value is censored: at least its smallest possible place, the bound 4.0
    assert bench.order_statistic(observed, bounds, 4) == (4.0, False)
    assert bench.order_statistic(observed, bounds, 6) is None
    assert bench.order_statistic(observed, bounds, 0) is None


def test_order_statistic_a_lower_bound_when_a_censored_value_may_come_first() -> None:
    bench = load_script("continuous_batching")
    # a request added late: stopped 0.5 s after it arrived, it could still come before 2.0
    value, exact = bench.order_statistic([1.0, 2.0, 3.0], [0.5], 2)
    assert not exact
    assert value == 1.0  # second of 0.5, 1.0, 2.0, 3.0: the true 2nd value is >= 1.0
    assert bench.order_statistic([1.0, 2.0, 3.0], [2.0], 2) == (2.0, True)  # tie: c > 2.0


def test_censored_ttft_all_observed_matches_the_plain_statistics() -> None:
    bench = load_script("continuous_batching")
    values = [0.4, 0.1, 0.3, 0.2, 0.9, 0.5]
    got = bench.censored_ttft(values, [])
    assert got["ttft_median_s"] == pytest.approx(statistics.median(values))
    assert got["ttft_p95_s"] == pytest.approx(0.9)
    assert got["first_tokens"] == got["ttft_requests"] == 6
    assert not any(k.endswith("_at_least") for k in got)


def test_censored_ttft_exact_median_bounded_p95() -> None:
    bench = load_script("continuous_batching")
    # 5 of 8 requests got a first token by the stop; the 3 others waited at least 10 s
    got = bench.censored_ttft([1.0, 2.0, 3.0, 4.0, 5.0], [10.0, 10.0, 10.0])
    assert got["ttft_median_s"] == pytest.approx(4.5)  # 4th and 5th values, both seen
    assert got["ttft_p95_s_at_least"] == pytest.approx(10.0)
    assert "ttft_p95_s" not in got and "ttft_median_s_at_least" not in got
    assert got["first_tokens"] == 5 and got["ttft_requests"] == 8


def test_censored_ttft_median_only_bounded_when_fewer_than_half_observed() -> None:
    bench = load_script("continuous_batching")
    got = bench.censored_ttft([1.0, 2.0], [6.0, 8.0, 9.0])
    assert got["ttft_median_s_at_least"] == pytest.approx(6.0)
    assert "ttft_median_s" not in got
    assert got["ttft_p95_s_at_least"] == pytest.approx(9.0)


def test_censored_ttft_none_observed_and_no_requests() -> None:
    bench = load_script("continuous_batching")
    got = bench.censored_ttft([], [3.0, 1.0])
    assert got["ttft_median_s_at_least"] == pytest.approx(2.0)  # mean of the two bounds
    assert got["ttft_p95_s_at_least"] == pytest.approx(3.0)
    assert got["first_tokens"] == 0
    assert bench.censored_ttft([], []) == {"ttft_requests": 0, "first_tokens": 0}


def _state(rid: str, created: float, stamps: list[float]) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, created_time=created, timestamps=stamps)


def test_first_tokens_keeps_a_request_recomputed_after_eviction() -> None:
    bench = load_script("continuous_batching")
    taken: list[str] = []
    scheduler = SimpleNamespace(add_waiting_request=lambda s: taken.append(s.request_id))
    manager = SimpleNamespace(batch_processor=SimpleNamespace(scheduler=scheduler))
    tracker = bench.FirstTokens(manager)
    scheduler.add_waiting_request(_state("a", 10.0, [10.5, 10.6]))
    # evicted and recomputed: a new state, its creation time and timestamps restarted
    scheduler.add_waiting_request(_state("a", 12.0, [14.0]))
    scheduler.add_waiting_request(_state("b", 11.0, []))
    assert taken == ["a", "a", "b"]  # transformers' own method still runs
    assert tracker.first_token("a") == (10.0, 10.5)
    assert tracker.first_token("b") == (11.0, None)
    assert tracker.first_token("c") == (None, None)
    fields = bench.ttft_fields(tracker, {"a": 10.0, "b": 11.0, "c": 13.0}, 15.0, {})
    assert fields["first_tokens"] == 1 and fields["ttft_requests"] == 3
    # b waited 4 s, c (still queued, not seen by the scheduler) 2 s: the median is bounded
    assert fields["ttft_median_s_at_least"] == pytest.approx(2.0)
    assert fields["ttft_finished_only_median_s"] is None


def test_first_tokens_without_the_scheduler_hook_says_so() -> None:
    bench = load_script("continuous_batching")
    tracker = bench.FirstTokens(SimpleNamespace(batch_processor=None))
    assert tracker.note is not None
    result = SimpleNamespace(timestamps=[2.0], created_time=1.0)
    fields = bench.ttft_fields(tracker, {"a": 1.0}, 5.0, {"a": result})
    assert fields["ttft_note"] == tracker.note
    assert fields["ttft_finished_only_median_s"] == pytest.approx(1.0)
    assert "ttft_median_s" not in fields and "first_tokens" not in fields


@pytest.mark.parametrize("arm", ["sdpa", "kvquant"])
def test_a_tiny_cpu_run_cut_by_its_timeout_records_first_tokens_of_unfinished_requests(
    arm: str, tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    bench = load_script("continuous_batching")
    out = tmp_path / "cb.json"
    # 12 requests of 900 new tokens, stopped after 2 s: none can finish (the SDPA arm's cache
    # holds 4 of them at once, kvquant's all 12), and the first ones have their first token
    argv = [
        "--tiny", "--arm", arm, "--device", "cpu", "--backend", "torch", "--modes", "burst",
        "--requests", "12", "--prompt", "8,16", "--new", "900,900", "--page", "1024",
        "--budget-gb", "0.002", "--timeout", "2", "--out", str(out),
    ]  # fmt: skip
    assert bench.main(argv) == 0
    (mode,) = json.loads(out.read_text())["modes"]
    assert mode["finished"] < mode["requests"] == mode["ttft_requests"] == 12
    assert "output_tokens_per_s_at_most" in mode
    assert mode["first_tokens"] > mode["finished"]
    assert "ttft_finished_only_median_s" in mode and "ttft_note" not in mode
    if arm == "kvquant":  # every request in flight from the first step
        assert mode["first_tokens"] == 12
        assert 0 < mode["ttft_median_s"] <= mode["ttft_p95_s"] < 2
    else:  # 4 in flight, the others waiting at the stop: at least 2 s each
        assert 4 <= mode["first_tokens"] < 12
        assert mode["ttft_p95_s_at_least"] >= 1.9 and "ttft_p95_s" not in mode
        if mode["first_tokens"] < 7:  # the 6th and 7th of 12 values are not both known
            assert "ttft_median_s" not in mode and mode["ttft_median_s_at_least"] > 0
