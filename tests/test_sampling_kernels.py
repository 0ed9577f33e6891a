"""The sampling kernels without a sort (CPU: csrc/sampling.c; GPU: batchrun/kernels/triton/sampling.py, interpreted without CUDA) against the
sorted definition of the kept set (model/sampling/sampler.py's docstring): the same threshold and token on rows with ties,
flat and peaked rows, top_p 1 and tiny, top_k 1, min_p; the draws' distribution; rows independent of their batch."""

import numpy as np
import pytest
import torch

from batchrun.kernels import cpu as cpu_kernels
from batchrun.kernels.cpu import sampling as cpu_sampling
from batchrun.model.sampling.sampler import SamplingBatch, argmax_rows, draw_reference, uniform

needs_c = pytest.mark.skipif(not cpu_kernels.available(), reason="needs the C kernels (a C compiler)")


def sorted_definition(w: np.ndarray, top_k: int, top_p: float, min_p: float, u: float) -> tuple[int, float]:
    """(token, threshold) of one row of weights w >= 0, by sorting: float64 sums, ties at a threshold all kept, the
    draw by inverse CDF over the kept tokens in id order."""
    w = w.astype(np.float64)
    vocab = len(w)
    ordered = np.sort(w)[::-1]
    t, mass = 0.0, w.sum()
    if 0 < top_k < vocab:
        t = ordered[min(top_k, max((w > 0).sum(), 1)) - 1]  # fewer than k tokens with mass: all of them
        mass = w[w >= t].sum()
    if top_p < 1:
        kept = ordered[ordered >= t]
        at = min(int(np.searchsorted(np.cumsum(kept), top_p * mass)), len(kept) - 1)
        t = max(t, kept[at])
    if min_p > 0:
        t = max(t, min_p * w.max())
    weights = np.where((w >= t) & (w > 0), w, 0.0)
    cdf = np.cumsum(weights)
    token = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), vocab - 1)
    return token, t


def _rows(rng: np.random.Generator, kind: str, vocab: int) -> np.ndarray:
    if kind == "flat":
        return np.ones(vocab, np.float32)
    if kind == "ties":
        w = np.full(vocab, 0.25, np.float32)
        w[rng.integers(0, vocab, 4)] = 1.0
        w[rng.integers(0, vocab, 9)] = 0.5
        return w
    if kind == "peaked":  # a language model's row: a few likely tokens, a long tail far below
        w = np.exp(rng.normal(size=vocab) * 4 - 20).astype(np.float32)
        w[rng.integers(0, vocab, 3)] = [1.0, 0.3, 0.05]
        return w
    if kind == "zeros":  # masked tokens (a grammar, a ban) carry no mass
        w = rng.random(vocab).astype(np.float32)
        w[rng.random(vocab) < 0.7] = 0.0
        w[rng.integers(0, vocab)] = 0.5  # (a row of logits always has a token with mass)
        return w
    return rng.random(vocab).astype(np.float32)


FILTERS = [(0, 1.0, 0.0), (1, 1.0, 0.0), (5, 1.0, 0.0), (50, 1.0, 0.0), (0, 0.9, 0.0), (0, 0.3, 0.0),
           (0, 1e-6, 0.0), (3, 0.8, 0.0), (0, 1.0, 0.2), (40, 0.95, 0.05), (0, 0.999999, 0.0)]


@needs_c
@pytest.mark.parametrize("kind", ["uniform", "flat", "ties", "peaked", "zeros"])
def test_the_c_kernels_kept_set_and_token_are_the_sorted_definitions(kind):
    rng = np.random.default_rng(["uniform", "flat", "ties", "peaked", "zeros"].index(kind))
    for vocab in (7, 100, 1000, 5003):
        w = np.stack([_rows(rng, kind, vocab) for _ in FILTERS * 3])
        top_k = np.array([f[0] for f in FILTERS] * 3, np.int64)
        top_p = np.array([f[1] for f in FILTERS] * 3, np.float32)
        min_p = np.array([f[2] for f in FILTERS] * 3, np.float32)
        u = rng.random(len(w))
        tokens, thresholds = cpu_sampling.sample_weights(torch.from_numpy(w), torch.from_numpy(top_k),
                                                         torch.from_numpy(top_p), torch.from_numpy(min_p),
                                                         torch.from_numpy(u))
        for r in range(len(w)):
            token, t = sorted_definition(w[r], top_k[r], float(top_p[r]), float(min_p[r]), u[r])
            assert (tokens[r].item(), thresholds[r].item()) == (token, np.float32(t)), (vocab, r)


def _batch(rows: int, temperature, top_k=None, top_p=None, min_p=None) -> SamplingBatch:
    def col(v, dtype):
        return None if v is None else torch.as_tensor(v, dtype=dtype).expand(rows).contiguous()

    return SamplingBatch(temperature=col(temperature, torch.float32), top_k=col(top_k, torch.int64),
                         top_p=col(top_p, torch.float32), min_p=col(min_p, torch.float32), seeds=None, counters=None,
                         all_greedy=False)


def _mixed_batch(rows: int, seed: int) -> SamplingBatch:
    g = torch.Generator().manual_seed(seed)
    pick = lambda *xs: torch.tensor(xs)[torch.randint(len(xs), (rows,), generator=g)]  # noqa: E731
    return SamplingBatch(temperature=pick(0.0, 0.5, 0.8, 1.0, 1.7).float(), top_k=pick(0, 0, 1, 20).long(),
                         top_p=pick(1.0, 1.0, 0.95, 0.5, 1e-6).float(), min_p=pick(0.0, 0.0, 0.1).float(),
                         seeds=None, counters=None, all_greedy=False)


@needs_c
def test_the_c_kernel_draws_what_the_torch_reference_draws():
    """On logits, the kernels' exp (within 2 ulp of torch's) may move a token across a kept set's edge or a draw's
    boundary once in a while: all but a few of thousands of rows agree, greedy rows always."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2048, 3000, generator=g) * 3
    logits[::7, ::5] = float("-inf")  # masked tokens in some rows
    b = _mixed_batch(2048, 1)
    u = uniform(torch.arange(2048), torch.zeros(2048, dtype=torch.int64))
    got = cpu_sampling.sample_rows(logits, b.temperature, b.top_k, b.top_p, b.min_p, u)
    want = draw_reference(logits, b, u)
    greedy = b.temperature == 0
    assert torch.equal(got[greedy], argmax_rows(logits)[greedy])
    assert (got == want).float().mean() > 0.995
    assert not torch.isinf(logits.gather(1, got[:, None])).any()  # a masked token is never drawn


def test_draws_follow_the_kept_distribution_chi_square():
    """20,000 draws (counters 0..19,999) of one row with top-k, top-p and min-p follow the kept tokens'
    renormalised probabilities (fixed seed: deterministic)."""
    logits = torch.tensor([[3.0, 2.5, 2.4, 2.0, 1.0, 0.5, -1.0, -2.0, 1.5, 0.0]])
    n = 20_000
    for top_k, top_p, min_p in ((0, 0.9, 0.0), (6, 1.0, 0.0), (0, 1.0, 0.15), (7, 0.97, 0.05)):
        b = _batch(n, 0.9, top_k, top_p, min_p)
        b.seeds, b.counters = torch.full((n,), 99), torch.arange(n)
        u = uniform(b.seeds, b.counters)
        e = torch.exp((logits[0] - logits.max()) / 0.9).double().numpy()
        kept = np.array([sorted_definition(e, top_k, top_p, min_p, 0.5)[1]])  # its threshold
        allowed = e >= kept[0]
        expected = np.where(allowed, e, 0) / e[allowed].sum() * n
        for path in ("reference", "c"):
            if path == "c" and not cpu_kernels.available():
                continue
            x = logits.expand(n, -1).contiguous()
            tok = (draw_reference(x, b, u) if path == "reference" else
                   cpu_sampling.sample_rows(x, b.temperature, b.top_k, b.top_p, b.min_p, u))
            observed = torch.bincount(tok, minlength=10).double().numpy()
            assert observed[~allowed].sum() == 0, (path, top_k, top_p, min_p)
            chi2 = ((observed - expected)[allowed] ** 2 / expected[allowed]).sum()
            assert chi2 < 27.9, (path, top_k, top_p, min_p, chi2)  # <= 9 degrees of freedom: p = 0.001


@needs_c
def test_a_rows_draw_does_not_depend_on_its_batch():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(300, 4096, generator=g) * 4
    b = _mixed_batch(300, 4)
    u = uniform(torch.arange(300), torch.full((300,), 7))
    whole = cpu_sampling.sample_rows(logits, b.temperature, b.top_k, b.top_p, b.min_p, u)
    for lo, hi in ((0, 1), (17, 18), (5, 64), (100, 300)):
        part = cpu_sampling.sample_rows(logits[lo:hi], b.temperature[lo:hi], b.top_k[lo:hi], b.top_p[lo:hi],
                                        b.min_p[lo:hi], u[lo:hi])
        assert torch.equal(part, whole[lo:hi]), (lo, hi)


def test_top_k_one_and_a_tiny_top_p_are_the_argmax():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 777, generator=g) * 2
    u = uniform(torch.arange(64), torch.zeros(64, dtype=torch.int64))
    for b in (_batch(64, 1.3, top_k=1), _batch(64, 0.7, top_p=1e-7)):
        assert torch.equal(draw_reference(logits, b, u), logits.argmax(-1))
        if cpu_kernels.available():
            assert torch.equal(cpu_sampling.sample_rows(logits, b.temperature, b.top_k, b.top_p, b.min_p, u),
                               logits.argmax(-1))


def test_the_triton_kernel_draws_what_the_torch_reference_draws():
    """The GPU kernel (on CUDA tensors where there is a GPU, interpreted with TRITON_INTERPRET=1 without one):
    greedy rows their argmax, sampled rows the reference's token but for a few near a boundary (fp32 sums where the
    reference sums in fp64), never a token outside the kept set."""
    from test_kernels import DEVICE

    from batchrun.kernels.triton.sampling import sample_rows

    def sample_on_device(logits, temperature, top_k, top_p, min_p, u):  # the kernel's inputs there, its tokens back
        on = [None if t is None else t.to(DEVICE) for t in (logits, temperature, top_k, top_p, min_p, u)]
        return sample_rows(*on).cpu()

    g = torch.Generator().manual_seed(7)
    logits = torch.randn(48, 1000, generator=g) * 3
    logits[::5, ::3] = float("-inf")
    b = _mixed_batch(48, 8)
    u = uniform(torch.arange(48), torch.full((48,), 3))
    got = sample_on_device(logits, b.temperature, b.top_k, b.top_p, b.min_p, u)
    want = draw_reference(logits, b, u)
    greedy = b.temperature == 0
    assert torch.equal(got[greedy], argmax_rows(logits)[greedy])
    assert (got == want).float().mean() >= 0.97
    assert not torch.isinf(logits.gather(1, got[:, None])).any()
    # filters off for every row (None) and on: a row's token is the same whatever the other rows ask
    plain, x, u = _batch(8, 0.9), logits[:8], u[:8]
    assert torch.equal(sample_on_device(x, plain.temperature, None, None, None, u),
                       sample_on_device(x, plain.temperature, torch.zeros(8, dtype=torch.int64), torch.ones(8),
                                        torch.zeros(8), u))


@needs_c
@pytest.mark.parametrize("vocab", [7, 33, 49152])
@pytest.mark.parametrize("num_top", [0, 1, 5, 20])
def test_the_c_scores_are_log_softmax_ranks_and_top_k(vocab, num_top):
    """The C kernel against log_softmax: the token's log-probability (within a few fp32 steps), its rank counted on the logits
    (1 + the tokens with larger logits, ties never counted), the top k largest first, ties the smaller id first;
    with a -inf logit, ties and a row alone equal to the same row in a batch."""
    g = torch.Generator().manual_seed(vocab + num_top)
    logits = torch.randn(40, vocab, generator=g) * 4
    logits[:, ::3] = logits[:, ::3].round()  # ties
    logits[0, 1] = float("-inf")
    targets = torch.randint(0, vocab, (40,), generator=g)
    targets[1] = int(logits[1].argmax())
    lp, rank, top_lp, top_ids = cpu_sampling.score_rows(logits, targets, num_top)
    logp = logits.log_softmax(dim=-1)
    assert torch.allclose(lp, logp.gather(1, targets[:, None]).squeeze(1), atol=1e-5, rtol=0)
    assert torch.equal(rank, (logits > logits.gather(1, targets[:, None])).sum(-1) + 1)
    assert rank[1] == 1
    if num_top:
        k = min(num_top, vocab)
        order = sorted(range(vocab), key=lambda t: (-logits[5, t].item(), t))[:k]
        assert top_ids[5, :k].tolist() == order
        assert torch.allclose(top_lp[:, :k], logp.topk(k, dim=-1).values, atol=1e-5, rtol=0)
    alone = cpu_sampling.score_rows(logits[7:8].clone(), targets[7:8], num_top)
    assert torch.equal(alone[0], lp[7:8]) and torch.equal(alone[1], rank[7:8])
