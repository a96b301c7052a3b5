"""The study's findings (study/figures.py): per configuration, whether its time falls from the fewest
to the most nodes, with its accuracy, and which node counts missed the target, said either way."""

from scaletrain.study.figures import findings


def row(strategy, nodes, seconds, accuracy, to_target=None, **cell):
    return {"cell": {"cluster.nodes": nodes, "strategy.name": strategy, **cell}, "nodes": nodes,
            "train_seconds": seconds, "time_to_target": to_target, "test_accuracy": accuracy,
            "best_test_accuracy": accuracy + 0.01}


def test_a_time_that_falls_and_one_that_does_not_are_both_said():
    rows = [row("allreduce", 1, 100.0, 0.97), row("allreduce", 4, 40.0, 0.91),
            row("sync", 1, 100.0, 0.97, **{"optim.scale_lr": "none"}),
            row("sync", 4, 120.0, 0.47, **{"optim.scale_lr": "none"}), row("async", 2, 50.0, 0.9)]
    assert findings(rows, ("epochs", 12.0)) == [
        "allreduce: training time falls from 1 to 4 nodes, 100.0 s to 40.0 s; test accuracy 0.9700 to 0.9100 "
        "(-6.0 points)",
        "sync (optim.scale_lr=none): training time does not fall from 1 to 4 nodes, 100.0 s to 120.0 s; test "
        "accuracy 0.9700 to 0.4700 (-50.0 points)"]  # async ran at one node count: nothing to compare


def test_a_target_missed_is_named_with_the_best_accuracy_reached():
    rows = [row("sync", 1, 90.0, 0.96, 60.0), row("sync", 2, 50.0, 0.95, 30.0), row("sync", 4, 40.0, 0.93)]
    assert findings(rows, ("accuracy", 0.95)) == [
        "sync: 4 node(s) did not reach accuracy 0.95 (best test accuracy 0.9400)"]
    rows[2]["time_to_target"] = 25.0
    assert findings(rows, ("accuracy", 0.95))[0].startswith("sync: time to accuracy 0.95 falls from 1 to 4 nodes, "
                                                             "60.0 s to 25.0 s")
