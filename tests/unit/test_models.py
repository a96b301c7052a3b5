import pytest
import torch
from safetensors.torch import save_file

from scaletrain.config import ModelConfig
from scaletrain.models import PretrainedError, build_model, load_pretrained
from scaletrain.models.resnet import resnet


def count(m):
    return sum(p.numel() for p in m.parameters())


def test_resnet50_as_published():
    m = resnet("resnet50", 1000)
    assert count(m) == 25_557_032  # the published ResNet-50 parameter count
    assert [len(getattr(m, f"layer{i}")) for i in range(1, 5)] == [3, 4, 6, 3]
    m1200 = resnet("resnet50", 1200)
    assert count(m1200) == 25_557_032 + 2048 * 200 + 200  # about 26 million with 1,200 classes
    m1200.eval()
    with torch.no_grad():
        assert m1200(torch.randn(2, 3, 224, 224)).shape == (2, 1200)


@pytest.mark.parametrize("name, size", [("resnet8", 16), ("resnet20", 32), ("resnet18", 64)])
def test_small_resnets_forward(name, size):
    m = resnet(name, 10)
    assert m(torch.randn(2, 3, size, size)).shape == (2, 10)


def test_group_norm_replaces_batch_norm():
    m = resnet("resnet8", 10, norm="group")
    kinds = {type(x) for x in m.modules()}
    assert torch.nn.GroupNorm in kinds and torch.nn.BatchNorm2d not in kinds


def test_pretrained_head_reinitialised_and_reported(tmp_path):
    src = resnet("resnet8", 10)
    save_file(src.state_dict(), str(tmp_path / "w.safetensors"))
    torch.save({"state_dict": src.state_dict()}, tmp_path / "w.pt")
    for f in ("w.safetensors", "w.pt"):
        dst = resnet("resnet8", 7)
        head_before = dst.fc.weight.clone()
        assert load_pretrained(dst, tmp_path / f) == ["fc.weight", "fc.bias"]
        assert torch.equal(dst.conv1.weight, src.conv1.weight)
        assert torch.equal(dst.fc.weight, head_before)  # kept its own initialisation


def test_pretrained_other_mismatch_refused(tmp_path):
    sd = resnet("resnet8", 10).state_dict()
    wide = dict(sd, **{"conv1.weight": torch.zeros(8, 3, 3, 3)})
    torch.save(wide, tmp_path / "shape.pt")
    with pytest.raises(PretrainedError, match=r"tensor 'conv1.weight' has shape \(8, 3, 3, 3\)"):
        load_pretrained(resnet("resnet8", 10), tmp_path / "shape.pt")
    missing = {k: v for k, v in sd.items() if k != "layer1.0.conv1.weight"}
    torch.save(missing, tmp_path / "missing.pt")
    with pytest.raises(PretrainedError, match="lacks tensor 'layer1.0.conv1.weight'"):
        load_pretrained(resnet("resnet8", 10), tmp_path / "missing.pt")
    torch.save(dict(sd, extra=torch.zeros(1)), tmp_path / "extra.pt")
    with pytest.raises(PretrainedError, match="tensor 'extra' the model does not"):
        load_pretrained(resnet("resnet8", 10), tmp_path / "extra.pt")


class Evil:
    def __reduce__(self):
        return (print, ("unsafe code ran",))


def test_pretrained_never_unpickles_code(tmp_path, capfd):
    torch.save({"conv1.weight": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(PretrainedError, match="evil.pt: holds Python objects other than tensors") as e:
        load_pretrained(resnet("resnet8", 10), tmp_path / "evil.pt")
    # our own line: no advice to load it with weights_only=False
    assert "\n" not in str(e.value) and "weights_only=False" not in str(e.value)
    assert "unsafe code ran" not in capfd.readouterr().out
    with pytest.raises(PretrainedError, match="does not exist"):
        build_model(ModelConfig(name="resnet8", num_classes=10, init_from=str(tmp_path / "none.pt")))
