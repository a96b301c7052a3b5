"""One GPU's training rates, measured for the GPU catalogue's held-out check (gpu_catalogue.py --measured).

    python benchmarks/gpu_rates.py [--out FILE] [--budget-s 300]

On a CUDA machine with nothing but torch: for each row of ROWS (network, arithmetic, batch), a
bare training step (forward, cross-entropy, backward, SGD with momentum) on a batch already on
the GPU, so that neither loaders nor the host's input enter: warm-up steps (cuDNN's autotuner),
then the median of three timed windows of STEPS steps, each closed by a device sync. Arithmetic:
fp32 (tf32 off), tf32 (cuDNN and matmul tf32 on) and bf16 (autocast, channels-last). ResNet-50
is scaletrain's own (models/resnet.py, loaded by its file); ResNeXt-101 32x4d is catalogue_nets.py's.
Prints one JSON object (the GPU's name, torch, each row's images/s and its windows' spread) and
writes it to --out. Rows left when --budget-s runs out are recorded as not measured.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
WARMUP, STEPS, WINDOWS = 8, 15, 3
# (network, mode, batch): DeepLearningExamples' batches where its tables give them (resnet50 256 in
# tf32/bf16, resnext 128), halved for fp32 as its fp32 rows do; resnet50 bf16 at 64 is this project's
# own earlier H100 point's batch
ROWS = (
    ("resnet50", "bf16", 256), ("resnet50", "bf16", 64), ("resnet50", "tf32", 256), ("resnet50", "fp32", 128),
    ("resnext101-32x4d", "bf16", 128), ("resnext101-32x4d", "tf32", 128), ("resnext101-32x4d", "fp32", 64),
)


def network(name: str) -> torch.nn.Module:
    if name == "resnet50":
        spec = importlib.util.spec_from_file_location("st_resnet", HERE.parent / "src/scaletrain/models/resnet.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.resnet("resnet50", 1000)
    sys.path.insert(0, str(HERE))
    from catalogue_nets import resnext101_32x4d
    return resnext101_32x4d(1000)


def rate(name: str, mode: str, batch: int) -> dict:
    """Images/s of the bare step, the median of WINDOWS windows, and their spread."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = mode == "tf32"
    fmt = torch.channels_last if mode == "bf16" else torch.contiguous_format
    model = network(name).cuda().to(memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)
    x = torch.randn(batch, 3, 224, 224, device="cuda").to(memory_format=fmt)
    y = torch.randint(0, 1000, (batch,), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "bf16"):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    rates = []
    for _ in range(WINDOWS):
        t = time.perf_counter()
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
        rates.append(batch * STEPS / (time.perf_counter() - t))
    del model, opt, x, y
    torch.cuda.empty_cache()
    med = statistics.median(rates)
    return {"model": name, "mode": mode, "batch": batch, "images_per_s": round(med, 1),
            "spread": round((max(rates) - min(rates)) / med, 4), "layout": "channels_last" if mode == "bf16" else "nchw"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--budget-s", type=float, default=300.0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(f"gpu_rates: skipped: no CUDA in torch {torch.__version__}", file=sys.stderr)
        return 0
    torch.backends.cudnn.benchmark = True
    start, rows = time.monotonic(), []
    for name, mode, batch in ROWS:
        if time.monotonic() - start > args.budget_s:
            rows.append({"model": name, "mode": mode, "batch": batch, "images_per_s": None, "why": "budget spent"})
            continue
        print(f"gpu_rates: {name} {mode} batch {batch}", file=sys.stderr, flush=True)
        rows.append(rate(name, mode, batch))
        print(f"gpu_rates:   {rows[-1]['images_per_s']} img/s", file=sys.stderr, flush=True)
    out = {"benchmark": "gpu_rates", "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "warmup_steps": WARMUP, "steps": STEPS, "windows": WINDOWS,
           "rows": rows, "seconds": round(time.monotonic() - start, 1),
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
