"""`ecomla.distill.losses`: KD divergences, sparse (top-k + tail) teachers, chunked + checkpointed sums.

Proves: each divergence equals its textbook formula (with the T² factor); a top-k
teacher with k = V is the dense teacher, values and gradients; with k < V it is the
divergence of the coarsened pair, which lower-bounds the full one; chunking and
checkpointing change neither values nor gradients; masked rows never leak; and a
checkpointed chunked loss does not keep N×V logits for backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ecomla.distill.losses import (
    KDLoss,
    LossConfig,
    TeacherDist,
    chunked_loss,
    kd_per_token,
    token_loss,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are tiny: intra-op threads only add contention (and seconds on a busy CI box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


KINDS = [KDLoss.FORWARD_KL, KDLoss.REVERSE_KL, KDLoss.JSD, KDLoss.SKEW_KL]
MIX = {KDLoss.JSD: 0.3, KDLoss.SKEW_KL: 0.1}


def spec_for(kind: KDLoss, temperature: float = 1.0, **kw) -> LossConfig:
    return LossConfig(kind=kind, temperature=temperature, mix=MIX.get(kind, 0.5), **kw)


def reference(kind: KDLoss, s: torch.Tensor, t: torch.Tensor, temperature: float) -> torch.Tensor:
    """Textbook divergence per row, in float64, times T²."""
    log_q = torch.log_softmax(s.double() / temperature, -1)
    log_p = torch.log_softmax(t.double() / temperature, -1)
    p, q = log_p.exp(), log_q.exp()
    if kind is KDLoss.FORWARD_KL:
        d = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)
    elif kind is KDLoss.REVERSE_KL:
        d = (q * (log_q - log_p)).sum(-1)
    elif kind is KDLoss.JSD:
        b = MIX[kind]
        m = b * p + (1 - b) * q
        d = b * (p * (p / m).log()).sum(-1) + (1 - b) * (q * (q / m).log()).sum(-1)
    else:
        a = MIX[kind]
        m = a * p + (1 - a) * q
        d = (p * (p / m).log()).sum(-1)
    return d * temperature**2


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_divergences_match_formulas(kind, temperature):
    s, t = torch.randn(7, 11) * 2, torch.randn(7, 11) * 2
    spec = spec_for(kind, temperature)
    got = kd_per_token(s, TeacherDist.from_logits(t, temperature), spec)
    assert got.dtype == torch.float32 and got.shape == (7,)
    torch.testing.assert_close(got.double(), reference(kind, s, t, temperature), rtol=1e-5, atol=1e-6)
    assert (got >= 0).all()
    same = kd_per_token(t, TeacherDist.from_logits(t, temperature), spec)
    torch.testing.assert_close(same, torch.zeros(7), rtol=0, atol=1e-6)


def test_teacher_with_zero_probability_ids():
    # A teacher with masked vocab entries (logit −inf, p = 0): 0·log 0 = 0 in value and in gradient.
    s, t = torch.randn(7, 11), torch.randn(7, 11)
    t[:, 8:] = -torch.inf
    p, q = torch.softmax(t.double(), -1), torch.softmax(s.double(), -1)

    def kl(a, b):  # Σ a·log(a/b) with 0·log 0 = 0
        return (torch.xlogy(a, a) - torch.xlogy(a, b)).sum(-1)

    m_jsd, m_skew = 0.3 * p + 0.7 * q, 0.1 * p + 0.9 * q
    want = {
        KDLoss.FORWARD_KL: kl(p, q),
        KDLoss.JSD: 0.3 * kl(p, m_jsd) + 0.7 * kl(q, m_jsd),
        KDLoss.SKEW_KL: kl(p, m_skew),
    }
    for kind, ref in want.items():
        s_ = s.clone().requires_grad_()
        got = kd_per_token(s_, TeacherDist.from_logits(t, 1.0), spec_for(kind))
        got.sum().backward()
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
        assert torch.isfinite(s_.grad).all()
    # Reverse KL is truly infinite there: the student puts mass where the teacher has none.
    assert torch.isposinf(kd_per_token(s, TeacherDist.from_logits(t, 1.0), spec_for(KDLoss.REVERSE_KL))).all()


def test_mix_at_its_ends_gives_the_limits():
    # JSD at β ∈ {0, 1} and skew KL at α = 1 compare a distribution with itself; skew KL at α = 0 is forward KL.
    s, t = torch.randn(7, 11), torch.randn(7, 11)
    for sparse in (TeacherDist.from_logits(t, 1.0), TeacherDist.topk_from_logits(t, 1.0, 4)):
        got = {(kind, mix): kd_per_token(s, sparse, LossConfig(kind=kind, mix=mix))
               for kind in (KDLoss.JSD, KDLoss.SKEW_KL) for mix in (0.0, 1.0)}
        assert all(torch.isfinite(d).all() for d in got.values())
        for key in ((KDLoss.JSD, 0.0), (KDLoss.JSD, 1.0), (KDLoss.SKEW_KL, 1.0)):
            torch.testing.assert_close(got[key], torch.zeros(7), rtol=0, atol=1e-6)
        forward = kd_per_token(s, sparse, LossConfig(kind=KDLoss.FORWARD_KL))
        torch.testing.assert_close(got[(KDLoss.SKEW_KL, 0.0)], forward)


def test_jsd_is_symmetric_with_mix_swapped():
    s, t = torch.randn(7, 11), torch.randn(7, 11)
    a = kd_per_token(s, TeacherDist.from_logits(t, 1.0), LossConfig(kind=KDLoss.JSD, mix=0.3))
    b = kd_per_token(t, TeacherDist.from_logits(s, 1.0), LossConfig(kind=KDLoss.JSD, mix=0.7))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", KINDS)
def test_topk_teacher_with_k_equal_v_is_dense(kind):
    s, t = torch.randn(7, 11) * 3, torch.randn(7, 11) * 3
    spec = spec_for(kind, 2.0)
    sparse = TeacherDist.topk_from_logits(t, 2.0, k=11)
    assert torch.isneginf(sparse.tail_logp).all()
    grads = []
    for teacher in (TeacherDist.from_logits(t, 2.0), sparse):
        s_ = s.clone().requires_grad_()
        d = kd_per_token(s_, teacher, spec)
        d.sum().backward()
        assert torch.isfinite(d).all() and torch.isfinite(s_.grad).all()
        grads.append((d.detach(), s_.grad))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_topk_teacher_is_the_coarsened_divergence_and_a_lower_bound(kind):
    s, t = torch.randn(7, 11) * 2, torch.randn(7, 11) * 2
    spec, k = spec_for(kind), 4
    sparse = TeacherDist.topk_from_logits(t, 1.0, k)
    p_tail = 1 - sparse.topk_logp.double().exp().sum(-1)
    torch.testing.assert_close(sparse.tail_logp.double().exp(), p_tail, rtol=0, atol=1e-6)

    got = kd_per_token(s, sparse, spec)
    dense = kd_per_token(s, TeacherDist.from_logits(t, 1.0), spec)
    assert (got <= dense + 1e-6).all() and (got < dense).any()

    # Coarsen both distributions onto (top-k ids, rest) in float64 and take the textbook divergence.
    def coarse(logits):
        p = torch.softmax(logits.double(), -1)
        top = p.gather(-1, sparse.topk_idx)
        return torch.cat([top, 1 - top.sum(-1, keepdim=True)], -1).log()

    torch.testing.assert_close(got.double(), reference(kind, coarse(s), coarse(t), 1.0), rtol=1e-5, atol=1e-6)


def test_student_tail_is_exact_when_the_top_k_hold_nearly_all_mass():
    # The student's tail is ~e^-40 of its mass: 1 − Σ top-k would round to 0 in float32
    # (log → −inf, and an infinite reverse KL), logsumexp over the rest does not.
    t = torch.zeros(3, 11)
    s = torch.full((3, 11), -40.0)
    s[:, :4] = 0.0
    t[:, :4] = 5.0
    sparse = TeacherDist.topk_from_logits(t, 1.0, k=4)
    for kind in KINDS:
        got = kd_per_token(s, sparse, spec_for(kind))
        want = reference(kind, _coarse(s, sparse.topk_idx), _coarse(t, sparse.topk_idx), 1.0)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def _coarse(logits, idx):
    lp = torch.log_softmax(logits.double(), -1)
    rest = lp.scatter(-1, idx, -torch.inf).logsumexp(-1, keepdim=True)
    return torch.cat([lp.gather(-1, idx), rest], -1)


def _loss_and_grads(hidden, head, teacher, targets, spec, **kw):
    h = hidden.clone().requires_grad_()
    head.zero_grad()
    sums = chunked_loss(h, head, teacher, targets, spec, **kw)
    sums.total.backward()
    return sums, h.grad, head.weight.grad.clone()


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "topk4"])
@pytest.mark.parametrize("checkpoint", [True, False], ids=["ckpt", "nockpt"])
@pytest.mark.parametrize("chunk_size", [1, 3, 5])
def test_chunked_loss_equals_unchunked(chunk_size, checkpoint, sparse):
    n, d, v, temperature = 13, 6, 11, 2.0
    head = torch.nn.Linear(d, v, bias=False)
    hidden, targets = torch.randn(n, d), torch.randint(0, v, (n,))
    t_logits = torch.randn(n, v) * 2
    full = TeacherDist.topk_from_logits(t_logits, temperature, 4) if sparse else None

    def teacher(s, e):
        return full.slice(s, e) if sparse else TeacherDist.from_logits(t_logits[s:e], temperature)

    for kind in KINDS:
        spec = spec_for(kind, temperature, ce_weight=0.5)
        # Reference: one token_loss over all rows, no chunks, no checkpoint.
        h = hidden.clone().requires_grad_()
        head.zero_grad()
        total, kd, ce = token_loss(head(h), teacher(0, n), targets, spec)
        total.sum().backward()
        want = (total.sum(), kd.sum(), ce.sum(), h.grad, head.weight.grad.clone())

        sums, g_h, g_w = _loss_and_grads(hidden, head, teacher, targets, spec,
                                         chunk_size=chunk_size, checkpoint=checkpoint)
        assert sums.tokens == n
        for got, ref in zip((sums.total, sums.kd, sums.ce, g_h, g_w), want):
            torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=1e-5)


def test_chunked_loss_of_no_rows_is_zero_and_backprops():
    head = torch.nn.Linear(4, 9, bias=False)
    h = torch.randn(0, 4, requires_grad=True)
    t = torch.randn(0, 9)
    sums = chunked_loss(h, head, lambda s, e: TeacherDist.from_logits(t[s:e], 1.0),
                        torch.zeros(0, dtype=torch.long), LossConfig(ce_weight=1.0), chunk_size=4)
    assert sums.tokens == 0 and sums.total.item() == 0 and sums.total.requires_grad
    assert sums.total.dtype == torch.float32 and sums.total.dim() == 0
    sums.total.backward()
    assert (head.weight.grad == 0).all()


def test_masked_rows_never_leak():
    b, t, d, v = 3, 5, 6, 11
    head = torch.nn.Linear(d, v, bias=False)
    mask = torch.rand(b, t) > 0.4
    mask[0, 0] = True
    mask[1, :] = False  # a row with no valid tokens at all
    hidden, t_logits = torch.randn(b, t, d), torch.randn(b, t, v)
    targets = torch.randint(0, v, (b, t))
    spec = LossConfig(kind=KDLoss.JSD, temperature=2.0, ce_weight=0.5)

    def run(hidden, t_logits, targets):
        h = hidden.clone().requires_grad_()
        rows, tl = h[mask], t_logits[mask]  # (N, d), (N, V): selection happens before the loss
        sums = chunked_loss(rows, head, lambda s, e: TeacherDist.from_logits(tl[s:e], 2.0),
                            targets[mask], spec, chunk_size=3)
        sums.total.backward()
        return sums, h.grad

    a, grad_a = run(hidden, t_logits, targets)
    garbage = ~mask
    hidden[garbage], t_logits[garbage], targets[garbage] = torch.nan, torch.inf, -100
    b_, grad_b = run(hidden, t_logits, targets)
    assert a.tokens == b_.tokens == int(mask.sum())
    for x, y in ((a.total, b_.total), (a.kd, b_.kd), (a.ce, b_.ce), (grad_a, grad_b)):
        assert torch.equal(x, y)
    assert (grad_b[garbage] == 0).all() and torch.isfinite(grad_b).all()


def test_checkpointed_chunks_do_not_save_full_logits():
    n, d, v, chunk = 256, 16, 2048, 32
    head = torch.nn.Linear(d, v, bias=False)
    hidden, targets = torch.randn(n, d, requires_grad=True), torch.randint(0, v, (n,))
    t_logits = torch.randn(n, v)
    spec = LossConfig(temperature=2.0, ce_weight=0.5)

    def saved_numel(checkpoint: bool) -> int:
        count = [0]

        def pack(x):
            count[0] += x.numel()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            sums = chunked_loss(hidden, head, lambda s, e: TeacherDist.from_logits(t_logits[s:e], 2.0),
                                targets, spec, chunk_size=chunk, checkpoint=checkpoint)
        sums.total.backward()  # and backward still works
        return count[0]

    assert saved_numel(checkpoint=False) >= n * v  # the probe does see the logits when they are kept
    assert saved_numel(checkpoint=True) < n * v / 2


def test_errors():
    s, targets = torch.randn(3, 5), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="needs a teacher"):
        token_loss(s, None, targets, LossConfig())
    with pytest.raises(ValueError, match="needs a teacher"):
        chunked_loss(s, lambda h: h, None, targets, LossConfig(ce_weight=1.0), chunk_size=2)
    with pytest.raises(ValueError):
        KDLoss("nope")
    with pytest.raises(ValueError, match="temperature.*mix"):
        LossConfig(temperature=0.0, mix=1.5)
    with pytest.raises(ValueError, match="nothing to train"):
        LossConfig(kind=KDLoss.NONE)
    assert LossConfig(kind="jsd").kind is KDLoss.JSD


def test_no_teacher_needed_without_kd():
    s, targets = torch.randn(3, 5), torch.randint(0, 5, (3,))
    for spec in (LossConfig(kind=KDLoss.NONE, ce_weight=1.0), LossConfig(kd_weight=0.0, ce_weight=1.0)):
        total, kd, _ = token_loss(s, None, targets, spec)
        torch.testing.assert_close(total, F.cross_entropy(s, targets, reduction="none"))
        assert (kd == 0).all()


def test_slice_and_validation_of_teacher_dist():
    t = torch.randn(6, 9)
    sparse = TeacherDist.topk_from_logits(t, 1.0, 3)
    part = sparse.slice(2, 5)
    assert torch.equal(part.topk_idx, sparse.topk_idx[2:5]) and part.logp is None
    with pytest.raises(ValueError):
        TeacherDist()
    with pytest.raises(ValueError):
        TeacherDist(logp=t, topk_idx=sparse.topk_idx, topk_logp=sparse.topk_logp, tail_logp=sparse.tail_logp)
    with pytest.raises(ValueError, match="k must be"):
        TeacherDist.topk_from_logits(t, 1.0, 10)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd", "skew_kl"])
def test_nan_teacher_is_not_silently_zeroed(kind):
    """A NaN in the teacher must give a NaN loss, so the trainer can stop; masking 0·log 0 must not hide it."""
    logits = torch.randn(3, 5)
    teacher_logits = torch.randn(3, 5)
    teacher_logits[1] = float("nan")
    spec = LossConfig(kind=KDLoss(kind))
    kd = kd_per_token(logits, TeacherDist.from_logits(teacher_logits, 1.0), spec)
    assert torch.isnan(kd[1]) and torch.isfinite(kd[[0, 2]]).all()
