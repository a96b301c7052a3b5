"""The gradient noise scale's estimator (noise.py) on a problem whose answer is known.

Linear regression y = x . w* + e, x ~ N(0, I_d), e ~ N(0, sigma^2), loss (x . w - y)^2 / 2, at a
fixed w = w* + delta. One example's gradient is (x . delta - e) x: its mean is G = delta and
tr(Sigma) = E|g|^2 - |G|^2 = |delta|^2 (d + 1) + sigma^2 d, so B_simple = d + 1 + sigma^2 d / |delta|^2.
"""

import math
import threading

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



def test_buckets_write_slots_of_their_own_summed_once_a_step():
    """DDP may run the buckets' callbacks at once (on GPU, on a pool of streams). None of them writes the
    window's shared sums, whose `+=` two streams could interleave and lose: each writes its own slot (its
    version moves, no other's), and the step sums them once, on the caller's thread. Callbacks run here
    from threads at once, each a bucket, as many backwards; the figure is the plain sum of every norm."""
    buckets, backwards = 6, 50
    noise = NoiseScale(8, 32, torch.device("cpu"))
    norms = [[(torch.tensor(float(1 + k + 10 * b)), torch.tensor(0.5 * (k + b))) for b in range(buckets)]
             for k in range(backwards)]
    gate = threading.Barrier(buckets + 1, timeout=60)  # a callback that raised breaks it: no hang

    def callbacks(b):
        for k in range(backwards):
            gate.wait()  # a backward's buckets: all at once
            try:
                noise.add(*norms[k][b], bucket=b)
            finally:
                gate.wait()

    threads = [threading.Thread(target=callbacks, args=(b,)) for b in range(buckets)]
    for t in threads:
        t.start()
    try:
        for k in range(backwards):
            before = noise.sums._version
            gate.wait()
            gate.wait()  # every bucket of this backward has called back
            assert noise.sums._version == before, f"backward {k}: a callback wrote the shared sums"
            assert [float(noise.slots[b][0]) for b in range(buckets)] == [float(o) for o, _ in norms[k]]
            noise.step()
    except BaseException:
        gate.abort()  # no thread left waiting for this one
        raise
    finally:
        for t in threads:
            t.join()
    own = sum(float(o) for row in norms for o, _ in row)
    mean = sum(float(a) for row in norms for _, a in row)
    assert noise.sums.tolist() == [pytest.approx(own), pytest.approx(mean)] and noise.steps == backwards


def test_a_bucket_that_did_not_call_back_adds_nothing():
    """After DDP rebuilds its buckets there may be fewer of them: a slot from an earlier backward is not
    counted again."""
    noise = NoiseScale(8, 32, torch.device("cpu"))
    noise.add(torch.tensor(1.0), torch.tensor(2.0), bucket=0)
    noise.add(torch.tensor(3.0), torch.tensor(4.0), bucket=1)
    noise.step()
    noise.add(torch.tensor(5.0), torch.tensor(6.0), bucket=0)
    noise.step()
    assert noise.sums.tolist() == [9.0, 12.0] and noise.steps == 2
