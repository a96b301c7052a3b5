"""Gradient accumulation with two all-reduce replicas (real processes, gloo).

Each replica's k micro-batches make one update, all-reduced once: the first k-1 backwards sync
nothing (DDP's require_backward_grad_sync, as no_sync sets it), so the bytes the buckets' all-reduces
send per update are those of one batch's, and the update is that of one k times larger batch.
"""

from test_strategies import EXACT, cluster, max_diff, run


def test_two_replicas_all_reduce_once_an_update_and_match_the_larger_batch(tmp_path):
    short = [*EXACT, "train.steps=3", *cluster(2, 1)]
    s_whole, whole = run(tmp_path, "whole", *short, "data.batch_size=16")
    s_parts, parts = run(tmp_path, "parts", *short, "data.batch_size=4", "train.grad_accum_steps=4")
    assert max_diff(whole, parts) <= 1e-5
    for key in ("steps", "images_applied"):
        assert s_parts[key] == s_whole[key], key
    assert s_parts["steps"] == 3 and s_parts["images_applied"] == 3 * 2 * 16
    sent = s_parts["bytes_per_step"]["worker_sent"]
    assert sent > 0 and sent == s_whole["bytes_per_step"]["worker_sent"]  # k all-reduces would send k times it
