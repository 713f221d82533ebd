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


def test_logged_figures_are_shown_cut_to_their_width():
    """The script's log() figures with a progress report: `name value` pairs, 4 significant
    digits, cut with "..." past LOGGED_WIDTH (metrics.jsonl keeps them whole)."""
    from hpar.launcher.run.progress import LOGGED_WIDTH, logged_text

    assert logged_text({"acc": 0.912345, "lr": 1e-4}) == "acc 0.9123 lr 0.0001"
    assert logged_text(None) == "" and logged_text({}) == ""
    many = logged_text({f"metric_{i}": i / 3 for i in range(20)})
    assert len(many) == LOGGED_WIDTH and many.endswith("...") and many.startswith("metric_0 0 metric_1 0.3333")
