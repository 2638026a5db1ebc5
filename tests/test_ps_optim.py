"""Sparse row optimizers of the embedding PS against their dense definitions (tolerance 1e-6).

Which reference each test uses:

* SGD, Adagrad: ``torch.optim.SGD`` / ``torch.optim.Adagrad`` on the dense gradient with random, duplicated ids
  (rows without a gradient are unchanged by both definitions). With weight decay, only in the regime where every row
  gets a gradient every step (dense weight decay also shrinks untouched rows; a PS does not).
* Adam: ``torch.optim.Adam`` where every row gets a gradient every step (then per-row step = global step, and the
  moments decay identically); with random ids, a hand-written dense reference of the *same* lazy, per-row-step
  definition.
* RowWiseAdagrad: fbgemm's CPU TBE with ``EXACT_ROWWISE_ADAGRAD`` and a hand-written reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from persia_planner.modules.ps.optim import SGD, Adagrad, Adam, RowOptimizer, RowWiseAdagrad

ROWS, DIM, STEPS, BATCH = 50, 8, 6, 64
TOL = 1e-6


def _batches(seed: int, all_rows: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS batches of (ids with duplicates, per-occurrence grads); ``all_rows`` puts every row in every batch."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, ROWS // 2 if not all_rows else ROWS, (BATCH,), generator=g)
        if all_rows:
            ids = torch.cat([torch.arange(ROWS), ids])
        out.append((ids, torch.randn(ids.numel(), DIM, generator=g)))
    return out


def _w0(seed: int = 0) -> torch.Tensor:
    return torch.empty(ROWS, DIM).uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(seed))


def _dense_grad(ids: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    return torch.zeros(ROWS, DIM).index_add_(0, ids, grads)


def _train_sparse(opt: RowOptimizer, batches) -> tuple[torch.Tensor, torch.Tensor]:
    """What the store does: merge duplicate ids, sum their grads, step the gathered rows, scatter back."""
    w = _w0()
    s = opt.init_state(ROWS, DIM)
    for ids, grads in batches:
        uniq, inv = torch.unique(ids, return_inverse=True)
        g = torch.zeros(uniq.numel(), DIM).index_add_(0, inv, grads)
        w[uniq], s[uniq] = opt.step(w[uniq], s[uniq], g)
    return w, s


def _train_torch(make_opt, batches) -> torch.Tensor:
    p = torch.nn.Parameter(_w0())
    opt = make_opt([p])
    for ids, grads in batches:
        p.grad = _dense_grad(ids, grads)
        opt.step()
    return p.detach()


@pytest.mark.parametrize("all_rows", [False, True])
def test_sgd_equals_torch_sgd(all_rows):
    batches = _batches(1, all_rows)
    w, _ = _train_sparse(SGD(lr=0.1), batches)
    ref = _train_torch(lambda p: torch.optim.SGD(p, lr=0.1), batches)
    torch.testing.assert_close(w, ref, atol=TOL, rtol=0)


def test_sgd_weight_decay_equals_torch_when_all_rows_present():
    batches = _batches(2, all_rows=True)
    w, _ = _train_sparse(SGD(lr=0.1, weight_decay=0.01), batches)
    ref = _train_torch(lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.01), batches)
    torch.testing.assert_close(w, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("all_rows", [False, True])
def test_adagrad_equals_torch_adagrad(all_rows):
    batches = _batches(3, all_rows)
    w, s = _train_sparse(Adagrad(lr=0.1, eps=1e-10), batches)
    ref = _train_torch(lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-10, initial_accumulator_value=0.0), batches)
    torch.testing.assert_close(w, ref, atol=TOL, rtol=0)
    assert s.shape == (ROWS, DIM)


def test_adagrad_accumulator_and_weight_decay_equal_torch_when_all_rows_present():
    batches = _batches(4, all_rows=True)
    opt = Adagrad(lr=0.05, eps=1e-8, weight_decay=0.02, initial_accumulator_value=0.1)
    w, _ = _train_sparse(opt, batches)
    ref = _train_torch(
        lambda p: torch.optim.Adagrad(p, lr=0.05, eps=1e-8, weight_decay=0.02, initial_accumulator_value=0.1), batches
    )
    torch.testing.assert_close(w, ref, atol=TOL, rtol=0)


def test_adam_equals_torch_adam_when_all_rows_present():
    batches = _batches(5, all_rows=True)
    opt = Adam(lr=0.01, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.01)
    w, s = _train_sparse(opt, batches)
    ref = _train_torch(
        lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.01, foreach=False), batches
    )
    torch.testing.assert_close(w, ref, atol=TOL, rtol=0)
    assert torch.equal(s[:, -1], torch.full((ROWS,), float(STEPS)))  # per-row step counters


def _lazy_adam_reference(opt: Adam, batches) -> torch.Tensor:
    """Dense float64 reference of the same definition: moments and the step counter move only for rows with a grad."""
    w = _w0().double()
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    t = torch.zeros(ROWS, dtype=torch.float64)
    b1, b2 = opt.betas
    for ids, grads in batches:
        g = _dense_grad(ids, grads).double()
        touched = torch.zeros(ROWS, dtype=torch.bool)
        touched[ids] = True
        for r in touched.nonzero().flatten().tolist():  # the reference may loop; the optimizer may not
            t[r] += 1
            m[r] = b1 * m[r] + (1 - b1) * g[r]
            v[r] = b2 * v[r] + (1 - b2) * g[r] ** 2
            m_hat = m[r] / (1 - b1 ** t[r].item())
            v_hat = v[r] / (1 - b2 ** t[r].item())
            w[r] -= opt.lr * m_hat / (v_hat.sqrt() + opt.eps)
    return w.float()


def test_adam_lazy_per_row_steps_equals_dense_reference():
    batches = _batches(6, all_rows=False)
    opt = Adam(lr=0.01)
    w, s = _train_sparse(opt, batches)
    torch.testing.assert_close(w, _lazy_adam_reference(opt, batches), atol=TOL, rtol=0)
    # Rows never touched keep their weights and a zero step counter.
    untouched = torch.ones(ROWS, dtype=torch.bool)
    for ids, _ in batches:
        untouched[ids] = False
    assert untouched.any()
    assert torch.equal(w[untouched], _w0()[untouched])
    assert torch.equal(s[untouched, -1], torch.zeros(int(untouched.sum())))


def test_rowwise_adagrad_equals_reference():
    batches = _batches(7, all_rows=False)
    opt = RowWiseAdagrad(lr=0.05, eps=1e-8)
    w, s = _train_sparse(opt, batches)
    ref_w, ref_s = _w0().double(), torch.zeros(ROWS, dtype=torch.float64)
    for ids, grads in batches:
        g = _dense_grad(ids, grads).double()
        for r in torch.unique(ids).tolist():
            ref_s[r] += (g[r] ** 2).mean()
            ref_w[r] -= opt.lr * g[r] / (math.sqrt(ref_s[r]) + opt.eps)
    torch.testing.assert_close(w, ref_w.float(), atol=TOL, rtol=0)
    torch.testing.assert_close(s.squeeze(1), ref_s.float(), atol=0, rtol=TOL)
    assert opt.state_width(DIM) == 1


def test_rowwise_adagrad_equals_fbgemm_exact_rowwise_adagrad():
    fbgemm_training = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode

    tbe = fbgemm_training.SplitTableBatchedEmbeddingBagsCodegen(
        [(ROWS, DIM, EmbeddingLocation.HOST, fbgemm_training.ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.05,
        eps=1e-8,
        pooling_mode=PoolingMode.SUM,
    )
    tbe.split_embedding_weights()[0].copy_(_w0())
    batches = _batches(8, all_rows=False)
    for ids, grads in batches:
        tbe(ids, torch.arange(ids.numel() + 1)).backward(grads)  # one id per bag: the bag's grad is the row's
    w, s = _train_sparse(RowWiseAdagrad(lr=0.05, eps=1e-8), batches)
    torch.testing.assert_close(w, tbe.split_embedding_weights()[0], atol=TOL, rtol=0)
    torch.testing.assert_close(s.squeeze(1), tbe.split_optimizer_states()[0][0].reshape(-1), atol=0, rtol=TOL)


def test_step_does_not_modify_inputs_and_shapes():
    w, g = torch.randn(5, DIM), torch.randn(5, DIM)
    for opt in (SGD(), Adagrad(), RowWiseAdagrad(), Adam()):
        assert isinstance(opt, RowOptimizer)
        s = opt.init_state(5, DIM) + 0.5
        w0, s0 = w.clone(), s.clone()
        nw, ns = opt.step(w, s, g)
        assert torch.equal(w, w0) and torch.equal(s, s0)
        assert nw.shape == (5, DIM) and ns.shape == (5, opt.state_width(DIM)) and ns.dtype == torch.float32


@pytest.mark.parametrize(
    "make",
    [lambda: SGD(lr=-1.0), lambda: Adagrad(eps=-1.0), lambda: Adam(betas=(1.0, 0.9)), lambda: SGD(weight_decay=-1)],
)
def test_invalid_hyper_parameters(make):
    with pytest.raises(ValueError):
        make()
