"""The fusion engine on a CUDA device: equivalence (the zoo, and the models people write on
the batched path), fp16 autocast with per-member scaling, export to a CPU model, and array
sizing with the CUDA allocator's memory model.

These run only where torch sees a CUDA device (a session with the GPU runs them with
``pytest tests/fusion/test_fusion_cuda.py``); everywhere else they are skipped, saying so.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from _fusion_helpers import classification_batch, run_equivalence
from test_models_people_write import CASES as PEOPLE_WRITE
from torch import nn

import fusetune.fusion as fusion
from benchmarks.zoo import PointNet, ResNet18
from fusetune.fusion import sizing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: torch.cuda.is_available() is False")

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def _ieee_cuda_math() -> Iterator[None]:
    """TF32 rounds matmul and convolution inputs to 10-bit mantissas: compare in IEEE arithmetic."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    try:
        yield
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cudnn.deterministic) = saved


def on_cuda(make_batch):
    def batch(b: int):
        x, y = make_batch(b)
        return x.to(CUDA), y.to(CUDA)

    return batch


@pytest.mark.parametrize(
    ("factory", "in_shape", "classes"),
    [(lambda: ResNet18(width=4, classes=10), (3, 8, 8), 10), (lambda: PointNet(classes=5), (3, 10), 5)],
    ids=["resnet18", "pointnet"],
)
def test_zoo_models_match_separate_training_on_cuda(factory, in_shape, classes):
    lrs, mom = [0.05, 0.02, 0.1], [0.9, 0.5, 0.0]
    run_equivalence(
        lambda: factory().to(CUDA),
        on_cuda(lambda b: classification_batch(b, 6, in_shape, classes, torch.float64)),
        lambda i, m: torch.optim.SGD(m.parameters(), lr=lrs[i], momentum=mom[i], weight_decay=5e-4),
        lambda f: fusion.optim.SGD(f.parameters(), lr=lrs, momentum=mom, weight_decay=5e-4),
        b=3,
    )


@pytest.mark.parametrize("name", sorted(PEOPLE_WRITE))
def test_models_people_write_match_separate_training_on_cuda(name):
    # The batched path (vmap, twins folded inside it) on the device; see test_models_people_write.py.
    case = PEOPLE_WRITE[name]
    lrs, mom = [0.05, 0.02, 0.1], [0.9, 0.5, 0.0]

    def batch(b: int):
        x, y = case.make_batch(b)
        return (tuple(t.to(CUDA) for t in x) if isinstance(x, tuple) else x.to(CUDA)), y.to(CUDA)

    fused = run_equivalence(
        lambda: case.factory().to(CUDA), batch,
        lambda i, m: torch.optim.SGD(m.parameters(), lr=lrs[i], momentum=mom[i]),
        lambda f: fusion.optim.SGD(f.parameters(), lr=lrs, momentum=mom),
        b=3, loss_fn=case.loss_fn, zero_grad_params=case.zero_grad,
    )
    assert fused.batched_modules() == {path: None for path in case.batched}


def test_adam_float32_matches_torch_adam_on_cuda():
    lrs = [1e-2, 3e-3, 2e-2]
    run_equivalence(
        lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).to(CUDA),
        on_cuda(lambda b: classification_batch(b, 16, (1, 8, 8), 10, torch.float32)),
        lambda i, m: torch.optim.Adam(m.parameters(), lr=lrs[i]),
        lambda f: fusion.optim.Adam(f.parameters(), lr=lrs),
        b=3,
        dtype=torch.float32,
    )


def test_fp16_autocast_grad_scaler_skips_only_the_overflowing_member():
    # Member 1's scale overflows fp16 gradients (grads ~0.1 * 2**40 > 65504); the others' do not.
    scales = [2.0**8, 2.0**40, 2.0**12]
    b = len(scales)
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(CUDA) for _ in range(b)]
    initial = [copy.deepcopy(m.state_dict()) for m in members]
    refs = [copy.deepcopy(m) for m in members]
    fused = fusion.fuse(members)
    lrs = [0.1, 0.05, 0.02]
    fopt = fusion.optim.SGD(fused.parameters(), lr=lrs, momentum=0.9)
    ropts = [torch.optim.SGD(r.parameters(), lr=lr, momentum=0.9) for r, lr in zip(refs, lrs)]
    scaler = fusion.amp.GradScaler(b, init_scale=scales, growth_interval=2)
    rscalers = [torch.amp.GradScaler("cuda", init_scale=s, growth_interval=2) for s in scales]
    for step in range(5):
        x = torch.randn(b, 32, 16, device=CUDA)
        y = torch.randint(0, 4, (b, 32), device=CUDA)
        fopt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            losses = fusion.per_member_loss(F.cross_entropy, fused(x), y)
        scaler.scale(losses).sum().backward()
        scaler.step(fopt)
        scaler.update()
        for i, (r, o, s) in enumerate(zip(refs, ropts, rscalers)):
            o.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(r(x[i]), y[i])
            s.scale(loss).backward()
            s.step(o)
            s.update()
            assert scaler.get_scale()[i] == s.get_scale(), f"step {step}: scale of member {i}"
            got = fused.member_state_dict(i)
            for k, v in r.state_dict().items():
                # fp16 products accumulate in another order in a batched matmul than in B
                # separate ones: equal to fp16 precision, not bit for bit.
                torch.testing.assert_close(got[k], v, rtol=1e-2, atol=1e-3, msg=lambda m, where=f"step {step} member {i} {k}": f"{where}: {m}")
    for k, v in initial[1].items():
        assert torch.equal(fused.member_state_dict(1)[k], v), f"member 1 stepped despite overflowing: {k}"
    assert not torch.equal(fused.member_state_dict(0)["0.weight"], initial[0]["0.weight"])


def test_member_exported_from_cuda_loads_strictly_into_a_cpu_model():
    torch.manual_seed(0)
    members = [PointNet(classes=5) for _ in range(3)]
    fused = fusion.fuse(members).to(CUDA)
    opt = fusion.optim.Adam(fused.parameters(), lr=[1e-2, 1e-3, 3e-3])
    x = torch.randn(3, 4, 3, 10, device=CUDA)
    y = torch.randint(0, 5, (3, 4), device=CUDA)
    for _ in range(2):
        opt.zero_grad()
        fusion.per_member_loss(F.cross_entropy, fused(x), y).sum().backward()
        opt.step()
    fused.eval()
    with torch.no_grad():
        out = fused(x)
    plain = PointNet(classes=5)
    plain.load_state_dict({k: v.cpu() for k, v in fused.member_state_dict(2).items()}, strict=True)
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(x[2].cpu()), out[2].cpu(), rtol=1e-4, atol=1e-5)


def test_size_array_uses_the_cuda_allocator_and_respects_the_memory_limit():
    def factory() -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

    x, y = torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,))
    free = sizing.size_array(factory, x, y, device="cuda", candidates=(1, 2, 4), steps=1, rounds=1, cache=False)
    assert free.device_type == "cuda"
    assert free.member_bytes > 0 and free.max_members == 4
    assert set(free.speedup) == {1, 2, 4} and free.solo_steps_per_s > 0
    # Room for base + 2.5 members after the 20% headroom: B = 2 fits, B = 4 does not.
    limit = int((free.base_bytes + 2.5 * free.member_bytes) / 0.8)
    capped = sizing.size_array(factory, x, y, device="cuda", candidates=(1, 2, 4), steps=1, rounds=1, cache=False,
                               memory_limit=limit)
    assert capped.max_members == 2
