"""A training loop of your own, with scaletrain's strategies, checkpoints and figures around it.

    python examples/custom_loop.py --recipe recipes/digits.toml --set strategy.name=sync --set cluster.nodes=2 \
        --set cluster.gpus_per_node=2 --set cluster.num_ps=1        # starts the job's 5 processes here
    torchrun --standalone --nproc-per-node=2 examples/custom_loop.py --recipe recipes/digits.toml \
        --set cluster.gpus_per_node=2 --run-dir runs/mine           # or under torchrun, or srun
    python examples/custom_loop.py --recipe recipes/digits.toml --set parallel.stages=2 \
        --set cluster.gpus_per_node=4                               # 2 replicas, each split in 2 stages
"""

import argparse

import scaletrain


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="recipes/digits.toml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--run-dir")
    ap.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its checkpoint")
    args = ap.parse_args()
    cfg = scaletrain.load_config(args.recipe, args.overrides)

    with scaletrain.Job.from_env(cfg, run_dir=args.run_dir, resume=args.resume) as job:
        network = scaletrain.build_model(cfg.model)  # or any torch.nn.Module of yours
        # The strategy around it, resumed from the run's checkpoint; model(x) runs at train.precision and
        # compiled when train.compile; optimizer.zero_grad() zeroes in place where DDP's buckets hold them
        model, optimizer = job.wrap(network)
        for x, y in job.batches():  # this replica's share of each global batch, until the job's target
            optimizer.zero_grad()
            if job.stages > 1:  # parallel.stages: the pipeline's schedule runs the forward and backward
                loss = job.forward_backward(x, y)
            else:
                loss = job.loss(model(x), y)  # the recipe's: cross-entropy and weight decay; or F.cross_entropy
                loss.backward()
            job.step(loss)  # averaging or the parameter servers, the optimizer, evaluation, checkpoints
    figures = job.figures()  # summary.json's figures, on the chief; {} on the other workers
    if figures:
        print(f"test accuracy {figures['test_accuracy']:.4f}; {figures['images_per_sec']:.0f} images/s "
              f"over the job's {figures['train_seconds']:.1f} s; run dir {job.run_dir}")


if __name__ == "__main__":
    main()
