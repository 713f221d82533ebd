"""The worker-to-launcher line protocol and the heartbeat's process figures."""
import time

from hpar.workers import report


def test_emit_then_parse_round_trips_and_drops_non_finite_numbers(capsys):
    report.emit("metric", {"step": 3, "loss": float("nan"), "by_param": {"w": [1.5, float("inf")]}})
    line = capsys.readouterr().out.strip()
    assert report.parse(line) == ("metric", {"step": 3, "loss": None, "by_param": {"w": [1.5, None]}})
    assert report.parse("an ordinary log line") is None
    assert report.parse(report.TAG + "metric {not json") is None


def test_cpu_percent_measures_a_busy_loop_since_the_previous_heartbeat():
    report.process_figures()
    end = time.process_time() + 0.3
    x = 0
    while time.process_time() < end:
        x += 1
    busy = report.process_figures()
    assert busy["cpu_percent"] > 20.0, busy
    assert busy["rss_bytes"] > 10 * 2**20
    time.sleep(0.3)
    assert report.process_figures()["cpu_percent"] < busy["cpu_percent"]
