"""The GPU catalogue's achieved-rate factors, fitted and checked on a network not fitted to.

Each factor (perfmodel/gpus.py, FACTOR) is the fraction of the roofline bound of ResNet-50's
training step that a published single-GPU measurement reached (gpus.POINTS). The check predicts
ResNeXt-101 32x4d (gpus.CHECKS: the same tables, same GPUs and modes) from those factors alone:
grouped convolutions move far more bytes per FLOP than ResNet-50's, so a FLOPs-only factor would
call it nearly as fast per FLOP, where the roofline charges its bytes. Prints one JSON object:
the factors, each check's predicted and published img/s and error, and the errors' median and
maximum (the catalogue's held-out error, which cluster descriptions carry as their compute band).

Then whole nodes: the published 8-GPU rows of the same tables (one DGX node; never fitted to) are
predicted by the model from a cluster description of that node (cluster.py), all-reduce over
NVLink, so that the catalogue and the node's averaging are checked together, each with the band
a catalogue prediction carries (the ResNeXt check's largest error on compute) and whether the
published rate lies inside it: its coverage. The V100's mixed
precision is fp16, which scaletrain's recipes do not train, so its 8-GPU AMP row is left out.
Counting the networks on the meta device takes about half a minute.

    python benchmarks/gpu_catalogue.py [--save]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from scaletrain.config import load_config
from scaletrain.metrics import git_commit, run_info
from scaletrain.perfmodel import gpus
from scaletrain.perfmodel import cluster
from scaletrain.perfmodel.cluster import Cluster, profile_for
from scaletrain.perfmodel.layers import step_cost
from scaletrain.perfmodel.predict import predict

from catalogue_nets import resnext101_32x4d  # noqa: F401  (model.name catalogue_nets:resnext101_32x4d)

ROOT = Path(__file__).resolve().parents[1]


# (GPU, its NVLink Gbit/s each way a GPU, recipe precision, batch per GPU, published 8-GPU img/s, table)
NODE_CHECKS = (
    ("a100-80gb", 2400, "bf16", 256, 16621, "resnet50v1.5"),   # NVLink 3 through NVSwitch: 300 GB/s each way
    ("a100-80gb", 2400, "fp32", 256, 7248, "resnet50v1.5"),    # fp32 recipes train in tf32 there
    ("v100-16gb", 1200, "fp32", 112, 2855, "resnet50v1.5"),    # NVLink 2: 150 GB/s each way
    ("v100-32gb", 1200, "fp32", 112, 2766, "resnet50v1.5"),
)


def node_check(gpu: str, link: float, precision: str, batch: int, published: float, table: str) -> dict:
    cfg = load_config(None, ["model.name=resnet50", "model.num_classes=1000", "data.image_size=224",
                             f"data.batch_size={batch}", "data.name=synthetic", "cluster.nodes=1",
                             "cluster.gpus_per_node=8", f"train.precision={precision}", "strategy.name=allreduce"])
    prof, _ = profile_for(Cluster(gpu=gpu, gpus=8, gpu_link_gbps=link), {}, cfg, Path(f"{gpu} x 8"))
    got = predict(cfg, prof)["images_per_sec"]
    # the band every catalogue prediction carries: compute_s +- the held-out error (cluster.py), so
    # images/s between got / (1 + e) and got / (1 - e) where compute is the bottleneck
    e = cluster.CATALOGUE_ERROR
    band = [round(got / (1 + e), 1), round(got / (1 - e), 1)]
    return {"gpu": gpu, "gpus": 8, "precision": precision, "batch": batch, "published": published,
            "predicted": round(got, 1), "error": round(got / published - 1, 4), "band": band,
            "inside": band[0] <= published <= band[1], "source": gpus.DLE.format(table).replace("1 GPU", "8 GPUs")}


# One factor serves every batch: this row, the H200's ResNet-50 in bf16 at a quarter of its fitted
# batch (gpu_rates.py, the same run), shows what that costs at small batches.
BATCH_CHECKS = (gpus.Point("h200-141gb", "half", "resnet50", 64, 3497.9, gpus.OWN_H200),)

NETWORKS = {"resnet50": "resnet50", "resnext101-32x4d": "catalogue_nets:resnext101_32x4d"}


def cost(point: gpus.Point, cache: dict):
    key = (point.model, point.batch, point.mode == "half")
    if key not in cache:
        cfg = load_config(None, [f"model.name={NETWORKS[point.model]}", "model.num_classes=1000"])
        cache[key] = step_cost(cfg.model, 224, point.batch, half=point.mode == "half")
    return cache[key]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--save", action="store_true", help="also write benchmarks/results/gpu-catalogue-TIME-COMMIT.json")
    args = ap.parse_args()
    cache: dict = {}
    factors, flops_factor = {}, {}
    for p in gpus.POINTS:
        print(f"fitting {p.gpu} {p.mode} on {p.model} at batch {p.batch}", file=sys.stderr)
        c, g = cost(p, cache), gpus.gpu(p.gpu)
        factors[f"{p.gpu}/{p.mode}"] = round(gpus.fit(c, g, p.mode, p.images_per_s), 4)
        # the FLOPs-only alternative: the fraction of peak FLOP/s ResNet-50 reached, carried over as it is
        flops_factor[(p.gpu, p.mode)] = c.flops / g.peak[p.mode] / (p.batch / p.images_per_s)
    gpus.FACTOR.update({tuple(k.split("/")): v for k, v in factors.items()})
    checks = []
    for p in gpus.CHECKS:
        print(f"checking {p.gpu} {p.mode} on {p.model} at batch {p.batch}", file=sys.stderr)
        c, g = cost(p, cache), gpus.gpu(p.gpu)
        got = p.batch / gpus.step_s(c, g, p.mode, gpus.factor(g, p.mode)[0])
        flops_only = p.batch / (c.flops / (g.peak[p.mode] * flops_factor[(p.gpu, p.mode)]))
        checks.append({"gpu": p.gpu, "mode": p.mode, "model": p.model, "batch": p.batch,
                       "published": p.images_per_s, "predicted": round(got, 1),
                       "error": round(got / p.images_per_s - 1, 4),
                       "flops_only_predicted": round(flops_only, 1),
                       "flops_only_error": round(flops_only / p.images_per_s - 1, 4), "source": p.source})
    batch_checks = []
    for p in BATCH_CHECKS:
        c, g = cost(p, cache), gpus.gpu(p.gpu)
        got = p.batch / gpus.step_s(c, g, p.mode, gpus.factor(g, p.mode)[0])
        batch_checks.append({"gpu": p.gpu, "mode": p.mode, "model": p.model, "batch": p.batch,
                             "measured": p.images_per_s, "predicted": round(got, 1),
                             "error": round(got / p.images_per_s - 1, 4), "source": p.source})
    nodes = [node_check(*row) for row in NODE_CHECKS]
    errors = [abs(c["error"]) for c in checks]
    flops_errors = [abs(c["flops_only_error"]) for c in checks]
    out = {"benchmark": "gpu_catalogue", "factors": factors,
           "fitted_to": [vars(p) for p in gpus.POINTS], "checks": checks,
           "held_out_error": {"median": round(statistics.median(errors), 4), "max": round(max(errors), 4)},
           "flops_only_held_out_error": {"median": round(statistics.median(flops_errors), 4),
                                         "max": round(max(flops_errors), 4)},
           "batch_checks": batch_checks,
           "node_checks": nodes,
           "node_error": {"median": round(statistics.median(abs(n["error"]) for n in nodes), 4),
                          "max": round(max(abs(n["error"]) for n in nodes), 4)},
           "node_band_coverage": round(sum(n["inside"] for n in nodes) / len(nodes), 4),
           "launch_s": gpus.LAUNCH_S, **run_info(torch.device("cpu"))}
    text = json.dumps(out, indent=1)
    print(text)
    if args.save:
        path = ROOT / "benchmarks/results" / f"gpu-catalogue-{time.strftime('%Y-%m-%dT%H%MZ', time.gmtime())}-{git_commit()[:7]}.json"
        path.write_text(text + "\n")
        print(f"saved {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
