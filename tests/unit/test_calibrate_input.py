"""calibrate's input rate: images/s one loader core delivers from the recipe's own files, one more
figure of each round, written to the profile's input_rate; 0, with the reason said, where the data
is not read from files here or --no-input asks."""

import numpy as np
import pytest
from PIL import Image

from scaletrain import cli
from scaletrain.config import build_config, load_config
from scaletrain.errors import ProfileError
from scaletrain.perfmodel import calibrate as cal
from scaletrain.perfmodel import input_rate as inp
from scaletrain.perfmodel.profile import Profile, load_profile

from conftest import RECIPES

BIG = cal.BIG_MIN  # resnet8's gradient is smaller: the bandwidth message has BIG_MIN elements
# Hand-made medians of a 2-core CPU host's rounds (the figures of every measure but the input's).
FIGURES = {"cpu": {"optimizer_s": 1e-3, "accumulate_s": 1e-4, "copy_s": 1e-4},
           "job1": {"step_s": 0.021}, "job1_other_batch": {"step_s": 0.011},
           "p2p": {"p2p_1": 5e-5, f"p2p_{BIG}": 5e-5 + 4 * BIG / 2e9, "ar_1": 2e-4, f"ar_{BIG}": 2e-4 + 4 * BIG / 1e9},
           "allreduce": {"ar_1": 6e-4, f"ar_{BIG}": 6e-4 + 4 * BIG / 1e9},
           "job2": {"step_s": 0.03}, "ps_job": {"step_s": 0.05}}
HOST = {"device": "cpu", "gpus": 0, "cores": 2, "allreduce_over": 2, "big_elements": BIG, "other_batch": 4}
GPU_HOST = {**HOST, "device": "cuda", "gpus": 1}  # no PS job to fit: derive in milliseconds, not seconds


def jpeg_folder(root, classes=2, per_class=6):
    """root/cK/I.jpg: small JPEGs of noise, larger than the input side so the crop resizes them."""
    rng = np.random.default_rng(0)
    for k in range(classes):
        (root / f"c{k}").mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (30, 40, 3), dtype=np.uint8)).save(root / f"c{k}/{i}.jpg")
    return root


def folder_cfg(root, name="imagefolder", **data):
    return build_config({"model": {"name": "resnet8", "num_classes": 2},
                         "data": {"name": name, "root": str(root), "image_size": 16, "batch_size": 8,
                                  "test_fraction": 0.25, "augment": ["resized-crop", "flip"], **data}})


def test_input_rate_of_an_image_folder_times_the_recipes_loader_work(tmp_path, monkeypatch):
    """One core's images/s over a fixed count after a warm-up, through the Samples a loader process
    calls, with the recipe's augmentations and image size; all the training images when fewer."""
    made = []

    class Spied(inp.Samples):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.calls = 0
            made.append(self)

        def __getitem__(self, key):
            self.calls += 1
            return super().__getitem__(key)

    monkeypatch.setattr(inp, "Samples", Spied)
    cfg = folder_cfg(jpeg_folder(tmp_path / "anp"))
    out = inp.input_measure(cfg, images=5, warmup=2)()
    assert out["images"] == 5 and out["images_per_s"] > 0
    (s,) = made
    assert s.size == 16 and s.augment.names == {"resized-crop", "flip"} and s.calls == 2 + 5
    assert inp.input_measure(cfg)()["images"] == 9  # 12 images, 3 held out: fewer than 64, all of them
    assert inp.input_text(cfg) == f"{tmp_path / 'anp'} (image folder, 16 px, resized-crop + flip)"


def test_input_rate_of_packed_shards(tmp_path):
    from scaletrain.data.shards import pack

    pack(folder_cfg(jpeg_folder(tmp_path / "anp")), tmp_path / "shards", 4096, progress=False)
    cfg = folder_cfg(tmp_path / "shards", name="shards")
    out = inp.input_measure(cfg, images=4, warmup=2)()
    assert out["images"] == 4 and out["images_per_s"] > 0
    assert inp.input_text(cfg) == f"{tmp_path / 'shards'} (packed shards, 16 px, resized-crop + flip)"


def test_no_input_rate_without_image_files_here(tmp_path):
    digits = load_config(RECIPES / "digits.toml")
    why = inp.input_unmeasured(digits)
    assert "'digits'" in why and "not read from image files" in why
    with pytest.raises(ProfileError, match="no input rate: data.name = 'digits'"):
        inp.input_measure(digits)
    absent = folder_cfg(tmp_path / "absent")
    assert inp.input_unmeasured(absent) == f"data.root {tmp_path / 'absent'} does not exist on this machine"
    with pytest.raises(ProfileError, match="does not exist"):
        inp.input_measure(absent)


def test_derive_writes_the_input_figure_to_input_rate():
    cfg = folder_cfg("/data/anp", workers=2)
    plain, _ = cal.derive(cfg, FIGURES, GPU_HOST, say=lambda *_: None)
    lines = []
    fed, _ = cal.derive(cfg, {**FIGURES, "input": {"images_per_s": 400.0, "images": 64}}, GPU_HOST,
                        say=lines.append)
    assert plain.input_rate == 0 and fed.input_rate == 400.0
    assert "  input: 400 img/s a loader core on /data/anp (image folder, 16 px, resized-crop + flip)" in lines
    assert fed.compute_s == pytest.approx(plain.compute_s)  # loader processes: not in the job's step
    # The jobs' training processes loaded their own batches: 8 images at 800 img/s are not compute.
    own, _ = cal.derive(folder_cfg("/data/anp", workers=0), {**FIGURES, "input": {"images_per_s": 800.0}}, GPU_HOST,
                        say=lambda *_: None)
    assert own.compute_s == pytest.approx(plain.compute_s - 8 / 800)


def fake_rounds(seen):
    """rounds() that records the measures, runs the input's for real and gives FIGURES for the rest."""
    def rounds(measures, runs, say):
        seen.extend(measures)
        m = {k: v for k, v in FIGURES.items() if k in measures}
        if "input" in measures:
            m["input"] = measures["input"]()
        return m, {f"{n}.{k}": 0.0 for n, figs in m.items() for k in figs}
    return rounds


def test_calibrate_measures_the_input_in_its_rounds_or_says_why_not(tmp_path, monkeypatch):
    seen, lines = [], []
    monkeypatch.setattr(cal, "rounds", fake_rounds(seen))
    monkeypatch.setattr(cal, "fit_transfer_load", lambda *_: 1.0)  # the PS job's fit: seconds, and not this test's
    root = jpeg_folder(tmp_path / "anp")
    prof, about = cal.calibrate(folder_cfg(root), say=lines.append)
    assert "input" in seen and prof.input_rate == about["measured"]["input.images_per_s"] > 0
    assert about["input"] == f"{root} (image folder, 16 px, resized-crop + flip)"
    assert any(line.startswith("  input: ") and f"img/s a loader core on {root} (image folder" in line
               for line in lines)

    seen.clear(), lines.clear()
    prof, about = cal.calibrate(folder_cfg(root, name="synthetic"), say=lines.append)
    assert "input" not in seen and prof.input_rate == 0
    assert ("  input: not measured, input_rate stays 0: data.name = 'synthetic' is not read from image files "
            "(imagefolder, manifest and shards are); calibrate a recipe whose data.root holds its images to model "
            "the loaders") in lines

    seen.clear(), lines.clear()
    prof, about = cal.calibrate(folder_cfg(root), say=lines.append, measure_input=False)
    assert "input" not in seen and prof.input_rate == 0 and about["input"] == "not measured: not asked for (--no-input)"


def test_no_input_flag_reaches_calibrate(tmp_path, monkeypatch):
    asked = []

    def fake(cfg, steps, runs, measure_input):
        asked.append(measure_input)
        return Profile(model="resnet8", gradient_bytes=4), {}
    monkeypatch.setattr("scaletrain.perfmodel.commands.calibrate", fake)
    for flags in ([], ["--no-input"]):
        out = tmp_path / "p.toml"
        assert cli.main(["calibrate", "--recipe", str(RECIPES / "digits.toml"), "--out", str(out), *flags]) == 0
        assert load_profile(out)[0].input_rate == 0
    assert asked == [True, False]
