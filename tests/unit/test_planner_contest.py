"""The pure parts of ``benchmarks/planner_contest.py``: who runs, in what order, who wins."""

import benchmarks.planner_contest as contest


def _timing(step_s, others=0.0):
    return {"step_time_s": step_s, "spread": 0.0, "others_cpu_share": others}


def test_contestants_are_the_measured_fastest_and_the_predicted_best_once_each():
    rows = [
        {"layout": name, "measured": _timing(t)}
        for name, t in (("a", 1.0), ("b", 1.2), ("c", 1.1), ("d", 0.9), ("e", 2.0))
    ]
    # on an idle machine "b" took 1.2 x 0.5: the fastest
    rows[1]["measured"] = _timing(1.2, others=0.5)
    assert contest.contestants(rows, ["e", "d", "a"]) == ["b", "d", "a", "e"]


def test_each_round_times_every_layout_once_in_a_rotating_order(monkeypatch):
    order = []

    def fake(model_flags, layout, steps, cache):
        order.append(layout)
        return _timing({"x": 2.0, "y": 1.0, "z": 3.0}[layout] + 0.01 * len(order))

    monkeypatch.setattr(contest, "timed_job", fake)
    runs = contest.run_contest(
        [], ["x", "y", "z"], rounds=3, steps=2, cache="", log=lambda *a, **k: None
    )
    assert order == ["x", "y", "z", "y", "z", "x", "z", "x", "y"]
    assert [layout for layout, _, _ in contest.ranking(runs)] == ["y", "x", "z"]
    # resumed: the rounds already timed are kept, only the missing ones run
    order.clear()
    runs["z"] = runs["z"][:2]
    again = contest.run_contest(
        [], ["x", "y", "z"], rounds=3, steps=2, cache="", runs=runs, log=lambda *a, **k: None
    )
    assert order == ["z"] and all(len(v) == 3 for v in again.values())


def test_ranking_takes_medians_of_idle_machine_times():
    runs = {
        "steady": [_timing(1.0), _timing(1.0), _timing(1.0)],
        # one slow outlier does not move a median; a loaded run counts its CPU share
        "lucky": [_timing(0.9), _timing(5.0), _timing(1.8, others=0.5)],
    }
    ranked = contest.ranking(runs)
    assert [layout for layout, _, _ in ranked] == ["lucky", "steady"]
    assert ranked[0][1] == 0.9 and ranked[1][2] == 0.0
