"""The gradient noise scale's estimator (noise.py) on a problem whose answer is known.

Linear regression y = x . w* + e, x ~ N(0, I_d), e ~ N(0, sigma^2), loss (x . w - y)^2 / 2, at a
fixed w = w* + delta. One example's gradient is (x . delta - e) x: its mean is G = delta and
tr(Sigma) = E|g|^2 - |G|^2 = |delta|^2 (d + 1) + sigma^2 d, so B_simple = d + 1 + sigma^2 d / |delta|^2.
"""

import math

import pytest
import torch

from scaletrain.noise import NoiseScale, half_batch, squared_norm, two_batch

D, SIGMA = 10, 1.0


def known(delta: torch.Tensor) -> float:
    return D + 1 + SIGMA ** 2 * D / float(delta.dot(delta))


def batch_gradient(delta, b, gen):
    x = torch.randn(b, D, generator=gen, dtype=torch.float64)
    e = SIGMA * torch.randn(b, generator=gen, dtype=torch.float64)
    return x.T @ (x @ delta - e) / b


def test_two_batch_inverts_the_expected_norms():
    g2, s = 3.0, 48.0
    assert two_batch(g2 + s / 8, g2 + s / 32, 8, 32) == (pytest.approx(g2), pytest.approx(s))


@pytest.mark.parametrize("replicas, b", [(4, 8), (2, 16)])
def test_the_estimate_is_within_ten_percent_of_the_known_noise_scale(replicas, b):
    gen = torch.Generator().manual_seed(0)
    delta = torch.full((D,), 1 / math.sqrt(D), dtype=torch.float64)  # |delta| = 1: B_simple = 21
    noise = NoiseScale(b, replicas * b, torch.device("cpu"))
    for _ in range(40):  # log windows
        for _ in range(100):  # steps
            grads = [batch_gradient(delta, b, gen) for _ in range(replicas)]
            mean = sum(grads) / replicas
            noise.add(grads[0].dot(grads[0]), mean.dot(mean))  # one replica's own norm, as each replica has
            noise.step()
        noise.window()
    assert noise.value == pytest.approx(known(delta), rel=0.10), (noise.value, known(delta))
    assert noise.overall == pytest.approx(known(delta), rel=0.05), (noise.overall, known(delta))  # 4,000 steps


def test_no_estimate_before_a_window_or_while_the_gradient_is_lost_in_noise():
    noise = NoiseScale(8, 16, torch.device("cpu"))
    assert noise.value is None and noise.window() is None and noise.overall is None

    def window(small, big):
        noise.add(torch.tensor(small), torch.tensor(big))
        noise.step()
        return noise.window()

    assert window(1.0, 1.0) == 0.0  # the mean's norm as large as one replica's: no noise
    assert window(40.0, 1.0) is None  # |G|^2 = (16 - 320) / 8 < 0: smoothed, still below 0
    with pytest.raises(ValueError, match="two batch sizes"):
        NoiseScale(8, 8, torch.device("cpu"))


def test_one_replica_measures_it_from_half_its_batch():
    """One process's two batch sizes: half its batch by half_batch's extra backward, then the whole."""
    gen = torch.Generator().manual_seed(1)
    b = 32
    model = torch.nn.Linear(D, 1, bias=False).double()
    with torch.no_grad():
        model.weight.fill_(1 / math.sqrt(D))  # w* = 0: |delta| = 1, B_simple = 21
    noise = NoiseScale(b // 2, b, torch.device("cpu"))
    loss_fn = lambda out, e: 0.5 * (out.squeeze(1) - e).pow(2).mean()  # noqa: E731
    for _ in range(20):
        for _ in range(100):
            x = torch.randn(b, D, generator=gen, dtype=torch.float64)
            e = SIGMA * torch.randn(b, generator=gen, dtype=torch.float64)
            out = model(x)
            half = half_batch(loss_fn, out, e, [model.weight])
            model.zero_grad()
            loss_fn(out, e).backward()  # the graph half_batch kept
            noise.add(half, squared_norm(p.grad for p in model.parameters()))
            noise.step()
        noise.window()
    assert noise.overall == pytest.approx(21.0, rel=0.10), noise.overall

