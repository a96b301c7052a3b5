"""data.decode = "device" on a GPU: nvJPEG through torchvision.io, the device-side fit, crop and flip, and
the side stream that brings each batch ahead. The path's logic is tested on a CPU, with libjpeg-turbo
as its decoder, in tests/unit/test_device_decode.py; here nvJPEG stands in, whose pixels differ from
libjpeg-turbo's by rounding (its own IDCT and chroma upsampling), so they are compared within a level
or two, not to the bit."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from scaletrain.data.augment import Augment
from scaletrain.data.device_input import DeviceBatches, decode_batch, host_decoder, nvjpeg_decoder, to_device
from scaletrain.data.loader import Prepare, Samples, collate
from scaletrain.data.sources import IMAGENET

from conftest import write_images

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SIZE = 32
NAMES = ["resized-crop", "crop", "flip", "color"]


@pytest.fixture
def nvjpeg():
    try:
        import torchvision.io  # noqa: F401 - optional extra: the test needs it, the project does not
    except Exception as e:  # noqa: BLE001 - missing, or built for another torch
        pytest.skip(f"torchvision does not import: {e}")


class Files(torch.utils.data.Dataset):
    """Eight JPEGs (smooth 120x90 ones and a noisy 300x200), 4:4:4, as FileDataset returns them."""

    stats = IMAGENET

    def __init__(self):
        yy, xx = np.mgrid[0:90, 0:120] / 90.0
        arrays = [(np.stack([np.sin(3 * xx + i), np.cos(2 * yy - i), np.sin(xx * yy * 4 + i)], -1) * 110 + 128)
                  .astype(np.uint8) for i in range(7)]
        arrays.append(np.random.RandomState(1).randint(0, 255, (200, 300, 3), dtype=np.uint8))
        self.items = []
        for a in arrays:
            buf = io.BytesIO()
            # 4:4:4: no chroma upsampling, whose filter nvJPEG and libjpeg-turbo need not share
            Image.fromarray(a).save(buf, "JPEG", quality=90, subsampling=0)
            self.items.append(buf.getvalue())

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i], i % 3

    def name(self, i):
        return f"file {i}"


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def encoded(epoch: int = 0, names=NAMES):
    ds = Files()
    return collate([Samples(ds, SIZE, Augment(names, 5), encoded=True)[(i, epoch)] for i in range(len(ds))])


def test_nvjpeg_decodes_as_libjpeg_turbo_does_within_rounding(nvjpeg):
    b = encoded().encoded
    streams = list(torch.split(b.data, b.lengths))
    full = [(0, 0)] * len(streams)
    gpu, cpu = nvjpeg_decoder(streams, full, device()), host_decoder(streams, full, torch.device("cpu"))
    for g, c in zip(gpu, cpu):
        assert g.is_cuda and g.dtype == torch.uint8 and g.shape == c.shape
        diff = (g.cpu().int() - c.int()).abs().float()
        assert diff.mean() < 1.5, diff.mean()


def test_the_device_path_on_a_gpu_gives_the_cpu_paths_batch_within_rounding(nvjpeg):
    for epoch in range(2):
        b = encoded(epoch)
        gpu = to_device(b, device())
        cpu = to_device(b, torch.device("cpu"), decoder=lambda s, least, d: host_decoder(s, [(0, 0)] * len(s), d))
        assert gpu.x.is_cuda and gpu.x.shape == cpu.x.shape == (8, SIZE, SIZE, 3) and gpu.bad == []
        assert torch.equal(gpu.y.cpu(), cpu.y) and torch.equal(gpu.params.cpu(), cpu.params)
        diff = (gpu.x.cpu().int() - cpu.x.int()).abs().float()
        assert diff.mean() < 2.0, (epoch, diff.mean())  # the same boxes, crops and flips: a mirrored one would be far


def test_a_cut_stream_does_not_stop_the_batch(nvjpeg):
    """A stream cut in half: named as a bad image when neither nvJPEG nor libjpeg-turbo decodes it
    (nvJPEG may decode what it has without complaint); the other samples go on either way."""
    ds = Files()
    ds.items[2] = ds.items[2][:len(ds.items[2]) // 2]
    b = collate([Samples(ds, SIZE, encoded=True)[(i, 0)] for i in range(len(ds))])
    x, keep, failed = decode_batch(b.encoded, device())
    assert [f.path for f in failed] in ([], ["file 2"]) and len(x) == len(keep) == 8 - len(failed)
    assert set(keep) | {2} == set(range(8))


def test_side_stream_batches_equal_the_batches_staged_in_line(nvjpeg):
    """Batch k+1 is copied and decoded on a side stream while batch k is used: what the step sees equals
    the same batch staged on the step's stream, even with the GPU kept busy in between."""
    loader = [encoded(e) for e in range(4)]
    dev = device()
    prepare = Prepare(NAMES, IMAGENET, dev)
    want = [prepare(to_device(b, dev))[0].cpu() for b in loader]
    got = []
    for b in DeviceBatches(loader, lambda b: to_device(b, dev), dev):
        torch.cuda._sleep(1 << 26)  # the step's stream busy while the side stream works ahead
        got.append(prepare(b)[0].cpu())
    assert len(got) == 4 and all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_job_decoding_on_its_gpu_trains(nvjpeg, train_run, tmp_path):
    write_images(tmp_path / "data", per_class=8, size=(96, 72))
    run = train_run("decode", "data.name=imagefolder", f"data.root={tmp_path / 'data'}", "model.num_classes=3",
                    "data.decode=device", "data.augment=resized-crop+flip", "data.batch_size=8", "data.workers=1",
                    "train.device=cuda", "train.steps=4", "train.log_every=1")
    s = run.summary
    assert s["steps"] == 4 and s["final_train_loss"] == s["final_train_loss"] and s["test_images"] > 0
