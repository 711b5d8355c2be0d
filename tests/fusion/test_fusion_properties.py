"""Property-based equivalence: random shapes, member counts and hyper-parameters."""

from __future__ import annotations

import torch
from _fusion_helpers import run_equivalence
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

import fusetune.fusion as fusion

lrs = st.floats(min_value=1e-4, max_value=0.5)


@settings(max_examples=15, deadline=None)
@given(
    b=st.integers(1, 4),
    features=st.integers(1, 5),
    hidden=st.integers(1, 6),
    classes=st.integers(2, 4),
    n=st.integers(2, 5),
    use_bn=st.booleans(),
    opt=st.sampled_from(["sgd", "adam"]),
    data=st.data(),
)
def test_random_mlps_match_separate_training(b, features, hidden, classes, n, use_bn, opt, data):
    # Two cases where the gradient of the first layer's weight is zero in exact arithmetic:
    # BatchNorm over 2 samples maps them to -1 and +1 whatever its input, and with one
    # input feature BatchNorm undoes the scale of each weight. The computed gradients are
    # rounding noise (~1e-17), which Adam scales up to updates of the size of lr: they
    # cannot be compared (see run_equivalence's zero_grad_params). Both failed before the
    # batched optimizers too (b=3, lr=0.5: n=2 at step 2; features=1, n=5 at step 0).
    assume(not (use_bn and opt == "adam" and (n == 2 or features == 1)))
    per_lr = data.draw(st.lists(lrs, min_size=b, max_size=b))
    momentum = data.draw(st.lists(st.sampled_from([0.0, 0.5, 0.9]), min_size=b, max_size=b))

    def factory() -> nn.Module:
        # No bias feeding BatchNorm under Adam: its true gradient is zero and
        # Adam would amplify rounding noise (see run_equivalence).
        layers: list[nn.Module] = [nn.Linear(features, hidden, bias=not (use_bn and opt == "adam"))]
        if use_bn:
            layers.append(nn.BatchNorm1d(hidden))
        layers += [nn.Tanh(), nn.Linear(hidden, classes)]
        return nn.Sequential(*layers)

    def batch(members: int):
        return torch.randn(members, n, features, dtype=torch.float64), torch.randint(0, classes, (members, n))

    if opt == "sgd":
        def ref(i, m):
            return torch.optim.SGD(m.parameters(), lr=per_lr[i], momentum=momentum[i])

        def fused(f):
            return fusion.optim.SGD(f.parameters(), lr=per_lr, momentum=momentum)
    else:
        def ref(i, m):
            return torch.optim.Adam(m.parameters(), lr=per_lr[i])

        def fused(f):
            return fusion.optim.Adam(f.parameters(), lr=per_lr)

    torch.manual_seed(0)
    run_equivalence(factory, batch, ref, fused, b=b, steps=3)
