"""Models as researchers write them fuse without the per-member loop and train exactly.

Each model is plain ``torch.nn`` with an unmodified forward (``benchmarks/zoo.py``): a
ViT's class token and position ``nn.Parameter``, a GPT's ``arange`` positions, causal-mask
buffer, ``F.scaled_dot_product_attention`` and tied output layer, a sinusoidal position
buffer, a ConvNeXt block's LayerScale gain, ``nn.RMSNorm``, ``weight_norm``
parametrizations, a CLIP-style learnable temperature, an einsum attention with a learned
position bias. The modules that own such tensors run on the batched path (once for all
members under ``torch.func.vmap``); every fused twin around and inside them stays fused.

For each: forward, backward and 5 optimizer steps (SGD and AdamW, every hyper-parameter per
member) equal B separately trained models; a member exported loads strict into the original
class and computes what the array computes; an array built from exported members and an
array whose member was replaced (prune + backfill) go on exactly like separate models.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _fusion_helpers import assert_close, compare_optimizer_state, compare_state, make_members, run_equivalence
from torch import nn

import fusetune.fusion as fusion
from benchmarks.zoo import (
    GPT,
    ContrastiveDualEncoder,
    ConvNeXt,
    EinsumTransformer,
    RMSNormMLP,
    SinusoidalTransformer,
    ViT,
    WeightNormTCN,
    contrastive_loss,
    lm_loss,
)

B = 3
D = torch.float64
Batch = tuple[Any, torch.Tensor]


def _images(channels: int, size: int, classes: int) -> Callable[[int], Batch]:
    return lambda b: (torch.randn(b, 4, channels, size, size, dtype=D), torch.randint(0, classes, (b, 4)))


def _tokens(vocab: int, length: int, classes: int) -> Callable[[int], Batch]:
    return lambda b: (torch.randint(0, vocab, (b, 4, length)), torch.randint(0, classes, (b, 4)))


def _next_tokens(b: int) -> Batch:
    return torch.randint(0, 20, (b, 4, 6)), torch.randint(0, 20, (b, 4, 6))


def _image_text_pairs(b: int) -> Batch:
    images = torch.randn(b, 4, 12, dtype=D)
    tokens = torch.randint(0, 20, (b, 4, 5))
    return (images, tokens), fusion.broadcast(torch.arange(4), b)  # image i matches text i


@dataclass(frozen=True)
class Case:
    factory: Callable[[], nn.Module]
    make_batch: Callable[[int], Batch]
    #: The modules the batched path runs (outermost ones), all of them batched by vmap.
    batched: frozenset[str]
    loss_fn: Callable[..., torch.Tensor] = F.cross_entropy
    #: Attention biases whose key part has a true gradient of exactly zero (a constant added
    #: to a softmax row): AdamW turns their rounding noise into updates that cannot be compared
    #: (see run_equivalence); their gradients are still compared.
    zero_grad: tuple[str, ...] = ()


CASES: dict[str, Case] = {
    # The root owns cls_token and pos_embed.
    "vit": Case(lambda: ViT(image=8, patch=4, d=8, heads=2, depth=2, classes=5), _images(3, 8, 5),
                frozenset({""}), zero_grad=("blocks.0.attn.in_proj_bias", "blocks.1.attn.in_proj_bias")),
    # The root calls wpe with a shared arange; the attentions own a mask buffer.
    "gpt": Case(lambda: GPT(vocab=20, d=8, heads=2, depth=2, context=8), _next_tokens, frozenset({""}),
                lm_loss, zero_grad=("h.0.attn.c_attn.bias", "h.1.attn.c_attn.bias")),
    "sinusoidal": Case(lambda: SinusoidalTransformer(vocab=20, d=8, heads=2, depth=1, classes=5),
                       _tokens(20, 6, 5), frozenset({"pos"}), zero_grad=("encoder.layers.0.self_attn.in_proj_bias",)),
    "convnext": Case(lambda: ConvNeXt(dim=8, depth=2, classes=5), _images(3, 8, 5),
                     frozenset({"blocks.0", "blocks.1"})),
    "rmsnorm": Case(lambda: RMSNormMLP(vocab=20, d=8, depth=2, classes=5), _tokens(20, 6, 5),
                    frozenset({"norms.0", "norms.1", "norm"})),
    "weight_norm": Case(lambda: WeightNormTCN(channels=3, hidden=6, classes=5),
                        lambda b: (torch.randn(b, 4, 3, 10, dtype=D), torch.randint(0, 5, (b, 4))),
                        frozenset({"conv1", "conv2", "head"})),
    "contrastive": Case(lambda: ContrastiveDualEncoder(features=12, vocab=20, d=8), _image_text_pairs,
                        frozenset({""}), contrastive_loss),
    "einsum": Case(lambda: EinsumTransformer(vocab=20, d=8, heads=2, tokens=6, depth=2, classes=5),
                   _tokens(20, 6, 5), frozenset({"attn.0", "attn.1"}), zero_grad=("attn.0.qkv.bias", "attn.1.qkv.bias")),
}

SGD = dict(lr=[0.05, 0.02, 0.1], momentum=[0.9, 0.5, 0.0], weight_decay=[0.0, 1e-3, 1e-2])
ADAMW = dict(lr=[1e-2, 3e-3, 2e-2], betas=[(0.9, 0.99), (0.8, 0.9), (0.9, 0.999)], weight_decay=[0.0, 0.01, 0.1])


def _optimizers(name: str, b: int = B) -> tuple[Callable[[int, nn.Module], Any], Callable[[nn.Module], Any]]:
    torch_cls, fused_cls, kw = ((torch.optim.SGD, fusion.optim.SGD, SGD) if name == "sgd"
                                else (torch.optim.AdamW, fusion.optim.AdamW, ADAMW))
    kw = {k: v[:b] for k, v in kw.items()}
    return (lambda i, m: torch_cls(m.parameters(), **{k: v[i] for k, v in kw.items()}),
            lambda f: fused_cls(f.parameters(), **kw))


@pytest.fixture
def no_fusion_warnings() -> Iterator[None]:
    """A module running once per member (FusionWarning), or a function that vmap runs once
    per member for want of a batching rule ("There is a performance drop"), fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", fusion.FusionWarning)
        warnings.filterwarnings("error", message="There is a performance drop")
        yield


def _inputs(x: Any) -> tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


@pytest.mark.usefixtures("no_fusion_warnings")
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_trains_like_separate_models_without_the_per_member_loop(name: str, opt: str) -> None:
    case = CASES[name]
    ref_opt, fused_opt = _optimizers(opt)
    fused = run_equivalence(case.factory, case.make_batch, ref_opt, fused_opt, b=B, steps=5, loss_fn=case.loss_fn,
                            zero_grad_params=case.zero_grad)
    # Each module with tensors but no twin runs batched under vmap, none once per member.
    assert fused.batched_modules() == {path: None for path in case.batched}


@pytest.mark.usefixtures("no_fusion_warnings")
@pytest.mark.parametrize("name", sorted(CASES))
def test_an_array_of_one_trains_like_the_model(name: str) -> None:
    # A batched module of one member runs its plain copy, without vmap.
    case = CASES[name]
    ref_opt, fused_opt = _optimizers("sgd", b=1)
    run_equivalence(case.factory, case.make_batch, ref_opt, fused_opt, b=1, steps=2, loss_fn=case.loss_fn,
                    zero_grad_params=case.zero_grad)


def _one_step(fused: fusion.FusedModel, opt: Any, case: Case, refs: list[nn.Module], ref_opts: list[Any]) -> None:
    """One training step of the array and of the separate models, compared after it."""
    x, y = case.make_batch(fused.num_members)
    opt.zero_grad()
    out = fused(*_inputs(x))
    fusion.per_member_loss(case.loss_fn, out, y).sum().backward()
    opt.step()
    for i, (r, o) in enumerate(zip(refs, ref_opts)):
        o.zero_grad()
        ref_out = r(*(t[i] for t in _inputs(x)))
        assert_close(out[i].detach(), ref_out.detach(), f"output of member {i}", D)
        case.loss_fn(ref_out, y[i]).backward()
        o.step()
    compare_state(fused, refs, D, "after a step", skip=case.zero_grad)
    compare_optimizer_state(opt, ref_opts, fused, refs, D, "after a step", skip_params=case.zero_grad)


@pytest.mark.usefixtures("no_fusion_warnings")
@pytest.mark.parametrize("name", sorted(CASES))
def test_export_import_and_backfill_round_trip(name: str) -> None:
    case = CASES[name]
    members = make_members(case.factory, B, D)
    refs = [copy.deepcopy(m) for m in members]
    fused = fusion.fuse(members)
    kw = {k: v for k, v in ADAMW.items()}
    opt = fusion.optim.AdamW(fused.parameters(), **kw)
    ref_opts = [torch.optim.AdamW(r.parameters(), **{k: v[i] for k, v in kw.items()}) for i, r in enumerate(refs)]
    _one_step(fused, opt, case, refs, ref_opts)

    # Export: each member is an ordinary model of the original class.
    x, _ = case.make_batch(B)
    fused.eval()
    with torch.no_grad():
        out = fused(*_inputs(x))
        for b in range(B):
            member = case.factory().to(D)
            member.load_state_dict(fused.member_state_dict(b), strict=True)
            member.eval()
            assert_close(out[b], member(*(t[b] for t in _inputs(x))), f"exported member {b}", D)
        # Import: an array built from the exported members computes the same.
        resumed = fusion.fuse_from_state_dicts(lambda: case.factory().to(D), [fused.member_state_dict(b) for b in range(B)])
        resumed.eval()
        assert_close(resumed(*_inputs(x)), out, "array built from exported members", D)
    fused.train()

    # Backfill: member 1 is pruned, a fresh model takes its place, and training goes on.
    fused.remove_members([1])
    opt.remove_members([1])
    del refs[1], ref_opts[1]
    torch.manual_seed(7)
    newcomer = case.factory().to(D)
    refs.append(copy.deepcopy(newcomer))
    ref_opts.append(torch.optim.AdamW(refs[-1].parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.05))
    fused.add_members([newcomer])
    opt.add_members(1, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.05)
    assert fused.num_members == B
    for _ in range(2):
        _one_step(fused, opt, case, refs, ref_opts)
    assert fused.batched_modules() == {path: None for path in case.batched}
