"""A job of pipeline stages whose every single send and receive is recorded as (sender, receiver) by a
pass-through around torch.distributed's, at start-up (up to the end of job.wrap) and after: each
process writes RUN_DIR/p2pRANK.json. Run as a script (the dist and GPU tests of the start-up's
pair warm-up): python tests/p2p_spy.py RECIPE RUN_DIR KEY=VALUE..."""

import json
import sys
from pathlib import Path


def pairs_used(run_dir: Path, rank: int) -> dict[str, set[frozenset]]:
    """The pairs a process sent or received on, by phase ("start", "after"), without their direction:
    a communicator is a pair's, whichever way it sends."""
    used = json.loads((Path(run_dir) / f"p2p{rank}.json").read_text())
    return {k: {frozenset(p) for p in v} for k, v in used.items()}


def main() -> None:
    import torch.distributed as dist  # the script's own: importing pairs_used needs no torch

    import scaletrain

    used, phase, send, recv = {"start": [], "after": []}, ["start"], dist.send, dist.recv

    def spy_send(tensor, *args, **kwargs):
        used[phase[0]].append((dist.get_rank(), kwargs["dst"]))
        return send(tensor, *args, **kwargs)

    def spy_recv(tensor, *args, **kwargs):
        used[phase[0]].append((kwargs["src"], dist.get_rank()))
        return recv(tensor, *args, **kwargs)

    dist.send, dist.recv = spy_send, spy_recv
    recipe, run_dir, sets = sys.argv[1], sys.argv[2], sys.argv[3:]
    cfg = scaletrain.load_config(recipe, ["model.name=resnet8", "train.steps=4", "train.eval_every=2",
                                          "train.checkpoint_every=2", "data.workers=0", *sets])
    with scaletrain.Job.from_env(cfg, run_dir=run_dir) as job:
        job.wrap(scaletrain.build_model(cfg.model))
        phase[0] = "after"
        for x, y in job.batches():
            job.step(job.forward_backward(x, y))
        rank = job.ctx.me.rank
    with open(f"{run_dir}/p2p{rank}.json", "w") as f:
        json.dump(used, f)


if __name__ == "__main__":
    main()
