"""Bring your own model: a small Transformer language model, tuned by a fusetune service.

Plain PyTorch: a token embedding plus a learned position table (an ``nn.Parameter`` of the
model itself), an ``nn.TransformerEncoder`` under a causal mask and a head over the
vocabulary, trained on the next token's cross-entropy. The data is a map-style ``Dataset``
of dict samples, ``{"input_ids": ..., "labels": ...}``; the default ``forward`` feeds the
model ``input_ids=`` and the default ``target_of`` gives the loss the ``labels``, which it
shifts by one position. Token accuracy and token loss are per-batch metrics
(``Metric(per_batch=True)``): a validation pass never holds the whole set's logits.

The sequences are generated here from a small grammar, so nothing is downloaded: each is a
random motif of 2 to 5 tokens (of 16) repeated to fill 24 positions. The first period is
noise, the rest can be predicted by looking back one period, which the model learns with
attention and its position table: a good trial predicts well over half of the tokens after
a few epochs, against 1/16 by chance. 2,000 training and 500 validation sequences: one
epoch of one trial takes well under a second on one CPU core.

Run it against a service (``make run`` starts one; see docs/examples/README.md)::

    python docs/examples/transformer_lm.py --url http://127.0.0.1:8000 --token $FUSETUNE_TOKEN
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import optuna
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from fusetune import Metric, Workload

VOCAB, LENGTH = 16, 24
PERIODS = (2, 3, 4, 5)
TRAIN_SEQUENCES, VAL_SEQUENCES = 2000, 500


# -- data ------------------------------------------------------------------------------------------


def motifs(size: int, generator: torch.Generator) -> torch.Tensor:
    """``size`` sequences of ``LENGTH`` tokens: each a random motif of a random period
    (``PERIODS``) repeated, ``token[t] = token[t - period]``."""
    periods = torch.tensor(PERIODS)[torch.randint(0, len(PERIODS), (size,), generator=generator)]
    tokens = torch.randint(0, VOCAB, (size, max(PERIODS)), generator=generator)
    positions = torch.arange(LENGTH) % periods[:, None]  # [size, LENGTH]: where in its motif
    return tokens.gather(1, positions)


class Motifs(Dataset[dict[str, torch.Tensor]]):
    """Generated sequences (made once from ``seed``) as dict samples: ``input_ids`` and
    ``labels`` are the same tokens (the loss and the metrics shift them)."""

    def __init__(self, size: int, seed: int) -> None:
        self.tokens = motifs(size, torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = self.tokens[index]
        return {"input_ids": tokens, "labels": tokens}


def datasets() -> tuple[Dataset[Any], Dataset[Any]]:
    """The training and validation sets: called by the workers, never when the workload is
    built or packaged."""
    return Motifs(TRAIN_SEQUENCES, seed=0), Motifs(VAL_SEQUENCES, seed=1)


# -- model -----------------------------------------------------------------------------------------


class TransformerLM(nn.Module):
    """Token embeddings plus a learned position table, ``layers`` pre-norm Transformer
    encoder layers under a causal mask (each position attends to itself and the ones before
    it), a final LayerNorm and a head over the vocabulary. No biases in the encoder (as in
    many recent LMs)."""

    def __init__(self, d_model: int = 32, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.randn(LENGTH, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=2 * d_model, dropout=0.0,
                                           batch_first=True, norm_first=True, bias=False)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[-1]
        h = self.embed(input_ids) + self.pos[:length]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=h.device, dtype=h.dtype)
        h = self.encoder(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))


def build_model(params: Any) -> nn.Module:
    """The trial's model: ``d_model`` and ``layers`` set its shapes (trials of equal ones fuse)."""
    return TransformerLM(int(params.get("d_model", 32)), int(params.get("layers", 2)))


# -- loss, metrics, what a trial tunes ---------------------------------------------------------------


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Every position's cross-entropy of the token after it."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The batch's mean next-token loss."""
    return float(next_token_loss(logits, labels))


def token_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The fraction of positions whose next token is the arg-max prediction."""
    return float((logits[:, :-1].argmax(-1) == labels[:, 1:]).float().mean())


def search_space(trial: optuna.Trial) -> dict[str, Any]:
    """AdamW's learning rate (log scale), weight decay and first beta, and the model's
    width (a categorical: one array per width)."""
    return {
        "lr": trial.suggest_float("lr", 1e-4, 3e-2, log=True),
        "weight_decay": trial.suggest_float("weight_decay", 1e-4, 0.3, log=True),
        "beta1": trial.suggest_float("beta1", 0.8, 0.95),
        "d_model": trial.suggest_categorical("d_model", [32, 64]),
    }


WORKLOAD = Workload(
    name="example-transformer-lm",
    build_model=build_model,
    search_space=search_space,
    datasets=datasets,
    loss=next_token_loss,
    metric=token_accuracy,
    metric_name="token_accuracy",
    direction="maximize",
    metrics=(
        Metric("token_accuracy", token_accuracy, per_batch=True),
        Metric("token_loss", token_loss, "minimize", per_batch=True),
    ),
    optimizer="AdamW",
    optimizer_defaults={"lr": 3e-3, "weight_decay": 0.01},
    batch_size=32,
    loader={"num_workers": 0},
    description="Transformer LM with a learned position table on repeated-motif sequences",
)


# -- the study ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--url", help="the service (default: FUSETUNE_URL, else http://127.0.0.1:8000)")
    parser.add_argument("--token", help="a tenant's token with code_upload (default: FUSETUNE_TOKEN)")
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0, help="the TPE sampler's seed")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the study")
    args = parser.parse_args(argv)

    from fusetune.client import Client, create_study

    study = create_study(
        workload=WORKLOAD, n_trials=args.trials, epochs=args.epochs, direction="maximize",
        sampler=optuna.samplers.TPESampler(seed=args.seed), url=args.url, token=args.token,
    )
    print(f"study {study.study_name!r}: {args.trials} trials of {WORKLOAD.name}, {args.epochs} epochs each")
    return wait_and_report(Client(args.url, token=args.token), study, args.timeout)


def wait_and_report(client: Any, study: optuna.Study, timeout: float) -> int:
    """Follow the study on the service's event stream until it ends, then print its best trial."""
    started = time.monotonic()

    def progress(s: dict[str, Any]) -> None:
        c = s["trial_counts"]
        print(f"  {time.monotonic() - started:6.1f}s  {s['state']:<9} waiting {c['WAITING']:>3}  running {c['RUNNING']:>3}  "
              f"complete {c['COMPLETE']:>3}  pruned {c['PRUNED']:>3}  failed {c['FAIL']:>3}", flush=True)

    with client:
        (found,) = client.studies(name=study.study_name)
        try:
            ended = client.wait(found["id"], timeout=timeout, poll=5.0, on_poll=progress)
        except TimeoutError as exc:
            print(f"{exc}; it goes on training on the service (see the dashboard)")
            return 1
        for warning in ended.get("warnings") or ():
            print(f"warning: {warning}")
    print(f"study {ended['state']} in {time.monotonic() - started:.1f} s")
    completed = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    if not completed:
        print("no trial completed")
        return 1
    best = study.best_trial
    print(f"best trial #{best.number}: {WORKLOAD.metric_name} {best.value:.4f}")
    for name, value in best.params.items():
        print(f"  {name} = {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
