"""data.decode = "device": the loader passes JPEG bytes, the training process decodes, fits, crops and
flips each batch on its device. On a CPU device the decoder is the loader path's own, so the device
path must give the loader path's pixels exactly, and a job trains to the same weights either way."""

import io

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from scaletrain.config import ConfigError, build_config
from scaletrain.data import build_datasets, check_data
from scaletrain.data.augment import Augment
from scaletrain.data.decode import fit as fit_uint8
from scaletrain.data.device_input import (DeviceBatches, Jpeg, fit_float, move, nvjpeg_decoder, to_device,
                                          torchvision_io)
from scaletrain.data.loader import Samples, collate, device_loader, train_loader
from scaletrain.data.sources import BadImage, IMAGENET, TensorDataset
from scaletrain.loop import train

from conftest import write_images

SIZE = 32
CPU = torch.device("cpu")


class Files(torch.utils.data.Dataset):
    """JPEGs (a few 120x90 and one 300x200, so the loader path decodes it at a reduced scale) and a PNG,
    as FileDataset returns them."""

    stats = IMAGENET

    def __init__(self):
        yy, xx = np.mgrid[0:90, 0:120] / 90.0
        self.items = []
        for i in range(6):
            img = np.stack([np.sin(3 * xx + i), np.cos(2 * yy - i), np.sin(xx * yy * 4 + i)], -1) * 110 + 128
            self.items.append(self._encode(img.astype(np.uint8), "JPEG"))
        big = np.random.RandomState(1).randint(0, 255, (200, 300, 3), dtype=np.uint8)
        self.items.append(self._encode(big, "JPEG"))
        self.items.append(self._encode(big[:50, :70], "PNG"))

    @staticmethod
    def _encode(arr, fmt):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        return buf.getvalue()

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i], i % 3

    def name(self, i):
        return f"file {i}"


def batches(ds, names, epoch, size=SIZE):
    a = Augment(names, 5) if names else None
    keys = [(i, epoch) for i in range(len(ds))]
    host = collate([Samples(ds, size, a)[k] for k in keys])
    encoded = collate([Samples(ds, size, a, encoded=True)[k] for k in keys])
    return host, encoded


@pytest.mark.parametrize("names", [[], ["flip"], ["crop", "flip"], ["resized-crop", "crop", "flip", "color"]],
                         ids=["none", "flip", "crop+flip", "resized-crop+crop+flip+color"])
def test_the_device_path_on_a_cpu_gives_the_loader_paths_pixels(names):
    for epoch in range(3):
        host, encoded = batches(Files(), names, epoch)
        dev = to_device(encoded, CPU)
        assert dev.x.shape == host.x.shape == (8, SIZE, SIZE, 3) and dev.x.dtype == torch.uint8
        assert torch.equal(dev.x, host.x), (names, epoch)
        assert torch.equal(dev.y, host.y) and dev.bad == host.bad == []
        assert (host.params is None and dev.params is None) or torch.equal(dev.params, host.params)


def test_the_device_path_of_a_tensor_dataset_moves_the_loaders_fitted_pixels():
    pool = torch.randint(0, 256, (10, 40, 40, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    ds = TensorDataset(pool, torch.arange(10) % 3, IMAGENET)
    host, encoded = batches(ds, ["resized-crop", "crop", "flip"], epoch=2)
    assert encoded.encoded.lengths == [] and len(encoded.encoded.pixels_at) == 10
    assert torch.equal(to_device(encoded, CPU).x, host.x)


def test_the_loader_hands_over_the_files_bytes_undecoded():
    ds = Files()
    item = Samples(ds, SIZE, Augment(["resized-crop"], 0), encoded=True)[(6, 0)][0]
    assert isinstance(item, Jpeg) and item.data == ds.items[6] and item.full == (300, 200)
    top, left, h, w = item.box
    assert 0 <= top and top + h <= 200 and 0 <= left and left + w <= 300
    b = collate([Samples(ds, SIZE, encoded=True)[(i, 0)] for i in range(len(ds))])
    assert b.x.numel() == 0 and b.encoded.jpeg_at == list(range(7)) and b.encoded.pixels_at == [7]
    assert bytes(b.encoded.data.numpy()) == b"".join(ds.items[:7])  # one buffer, the files' bytes in order


def test_crop_and_flip_draws_keep_their_distribution_on_the_device():
    """Flips fall on about half the samples, shifts on every offset of [-size/8, size/8], as the loader draws them."""
    a = Augment(["crop", "flip"], 3)
    moves = torch.tensor([a.moves(a.draws(0, i), SIZE) for i in range(2000)])
    assert 0.45 < moves[:, 2].float().mean() < 0.55
    assert set(moves[:, 0].tolist()) == set(range(-4, 5)) == set(moves[:, 1].tolist())


@pytest.mark.parametrize("size", [8, 9, 32])
def test_one_gather_equals_the_loaders_crop_and_flip(size):
    g = torch.Generator().manual_seed(size)
    x = torch.randint(0, 256, (64, size, size, 3), dtype=torch.uint8, generator=g)
    a = Augment(["crop", "flip"], 11)
    draws = [a.draws(1, i) for i in range(64)]
    expected = torch.stack([a.loader_ops(x[i], u) for i, u in enumerate(draws)])
    assert torch.equal(move(x, torch.tensor([a.moves(u, size) for u in draws])), expected)


def test_the_float_resize_of_gpus_is_within_a_level_of_the_uint8_kernel():
    """CUDA has no antialiased uint8 resize: the float one, rounded, stands in (tested here on the CPU)."""
    img = torch.from_numpy(np.array(Image.open(io.BytesIO(Files().items[6])).convert("RGB")))
    for box in [(0, 0, 200, 200), (10, 30, 150, 120), (5, 5, 20, 25)]:
        a, b = fit_float(img, box, SIZE).int(), fit_uint8(img, box, SIZE).int()
        assert a.shape == b.shape == (SIZE, SIZE, 3)
        assert (a - b).abs().max() <= 1 and (a - b).abs().float().mean() < 0.2


def test_a_jpeg_that_will_not_decode_becomes_a_bad_image_naming_it():
    ds = Files()
    ds.items[2] = ds.items[2][:len(ds.items[2]) // 2]  # a header that parses, a stream cut short
    b = collate([Samples(ds, SIZE, encoded=True)[(i, 0)] for i in range(len(ds))])
    assert b.bad == []  # the loader read the header only
    dev = to_device(b, CPU)
    assert [bad.path for bad in dev.bad] == ["file 2"] and "Error" in dev.bad[0].reason
    assert len(dev.x) == len(dev.y) == 7 and dev.y.tolist() == [0, 1, 0, 1, 2, 0, 1]


def test_device_batches_on_a_cpu_yield_each_batch_through_the_stage():
    ds = Files()
    loader = [collate([Samples(ds, SIZE, encoded=True)[(i, e)] for i in range(4)]) for e in range(3)]
    out = list(DeviceBatches(loader, lambda b: to_device(b, CPU), CPU))
    assert len(out) == 3 and all(b.encoded is None and b.x.shape == (4, SIZE, SIZE, 3) for b in out)


def test_a_gpu_decode_without_torchvision_is_refused_in_one_line():
    try:
        import torchvision.io  # noqa: F401
        pytest.skip("torchvision imports here")
    except Exception:  # noqa: BLE001 - what the project's machines give: missing or broken
        pass
    with pytest.raises(ConfigError) as e:
        torchvision_io()
    msg = str(e.value)
    assert "\n" not in msg and "data.decode = 'device'" in msg and "pip install" in msg and "data.decode = 'loader'" in msg
    with pytest.raises(ConfigError):
        nvjpeg_decoder([torch.zeros(4, dtype=torch.uint8)], [(0, 0)], torch.device("cuda"))
    # the loader of a CUDA device names it when it is made, before a batch is read (no CUDA call comes first)
    cfg = build_config({"data": {"name": "synthetic", "decode": "device", "workers": 0}})
    with pytest.raises(ConfigError, match="torchvision"):
        device_loader([], cfg, pin=True, device=torch.device("cuda", 0))


def test_data_decode_takes_loader_or_device_only():
    assert build_config({}).data.decode == "loader"
    with pytest.raises(ConfigError, match=r"data\.decode.*loader.*device"):
        build_config({"data": {"decode": "gpu"}})


def job_cfg(root, decode, **train):
    return build_config({"model": {"name": "resnet8", "num_classes": 3, "width": 8},
                         "data": {"name": "imagefolder", "root": str(root), "image_size": 16, "batch_size": 4,
                                  "workers": 1, "test_fraction": 0.25, "decode": decode,
                                  "augment": ["resized-crop", "crop", "flip", "color"]},
                         "train": {"steps": 4, "log_every": 2, "threads": 1, **train}})


def test_a_job_decoding_on_its_device_trains_as_the_loader_path_does(tmp_path):
    """JPEGs and PNGs of an image folder, a loader process: the same weights to the bit on a CPU device."""
    write_images(tmp_path / "data", per_class=6, size=(60, 44))
    check_data(job_cfg(tmp_path / "data", "device"))
    runs = {}
    for decode in ("loader", "device"):
        s = train(job_cfg(tmp_path / "data", decode), tmp_path / decode, progress=False)
        assert s["steps"] == 4 and s["final_train_loss"] == s["final_train_loss"]
        runs[decode] = load_file(tmp_path / decode / "model.safetensors")
        assert f'decode = "{decode}"' in (tmp_path / decode / "config.toml").read_text()
    assert runs["loader"].keys() == runs["device"].keys()
    assert all(torch.equal(runs["loader"][k], runs["device"][k]) for k in runs["loader"])


def test_the_train_loader_of_device_decode_yields_decoded_batches(tmp_path):
    write_images(tmp_path / "data", per_class=4, size=(60, 44))
    cfg = job_cfg(tmp_path / "data", "device").replace(**{"data.workers": 0})
    train_set, _, _ = build_datasets(cfg)
    loader, _ = train_loader(train_set, cfg, 0, 2)
    assert isinstance(loader, DeviceBatches)
    got = list(loader)
    assert len(got) == 2 and all(b.encoded is None and b.x.shape == (4, 16, 16, 3) for b in got)
    assert not any(isinstance(b, BadImage) for g in got for b in g.bad)
