"""Capture one real training step of a small model and replay it on every GPU with gpumon's canaries.

    python examples/sdc_capture_replay.py [--out DIR] [--workers N] [--device auto|cuda|cpu] [--demo-fault]

1. Builds a 2-layer transformer language model with torch.nn and trains it for a few steps on real
   text (this file's own bytes: no download), so that weights and AdamW moments are those of a model
   in training, not of a fresh initialisation.
2. Captures the next step with ``gpumon.sdc.capture``: module state, optimizer state, one batch, the
   seed and which module outputs to fingerprint, into a replay bundle (DIR/bundle).
3. Replays it on every GPU at once with ``gpumon canary run --bundle DIR/bundle``: each GPU is
   compared with the capture's own run (same key) and with the others; exit 0 means bit-exact.
4. With ``--demo-fault``, replays it again with the fault harness on worker 1 (bit flips in fp32
   kernel outputs) and shows that the canary names GPU 1 and the first differing tensor (exit 2).

Without GPUs, worker processes on the CPU stand in for them (``--device cpu``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

import gpumon.sdc
from gpumon.sdc.workloads import cross_entropy

SEQ = 32


class CharTransformer(nn.Module):
    """A byte-level language model: embedding, 2 pre-norm transformer layers, linear head."""

    def __init__(self, vocab: int = 256, d_model: int = 64, heads: int = 4, layers: int = 2,
                 seq: int = SEQ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.1, batch_first=True,
                                       norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.causal: torch.Tensor
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:n]
        for layer in self.layers:
            x = layer(x, src_mask=self.causal[:n, :n], is_causal=True)
        out: torch.Tensor = self.head(self.norm(x))
        return out


def make_model(**kwargs: int) -> nn.Module:
    """The factory replay uses to rebuild the module (then loads the captured state into it)."""
    return CharTransformer(**kwargs)


def next_byte_loss(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Cross entropy of the next byte. Written with a one-hot mask rather than F.cross_entropy, whose
    NLLLoss kernel has no deterministic CUDA implementation (torch refuses it in deterministic mode,
    and a canary must be deterministic)."""
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    return cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def batches(text: bytes, batch_size: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    data = torch.tensor(list(text), dtype=torch.long)
    starts = torch.randint(0, data.numel() - SEQ - 2, (batch_size,), generator=gen)
    return {"tokens": torch.stack([data[s:s + SEQ + 1] for s in starts.tolist()])}


def gpumon_canary() -> list[str]:
    """``gpumon canary`` when the CLI has it, else the canary module's own entry point."""
    wired = subprocess.run([sys.executable, "-m", "gpumon", "canary", "--help"], capture_output=True,
                           timeout=120).returncode == 0
    return [sys.executable, "-m", "gpumon", "canary"] if wired else [sys.executable, "-m", "gpumon.sdc.cli"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where the bundle and state go (default: a temp dir)")
    parser.add_argument("--workers", type=int, default=4, help="GPUs (or CPU workers) to replay on")
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument("--train-steps", type=int, default=5)
    parser.add_argument("--demo-fault", action="store_true",
                        help="also replay with the fault harness on worker 1 and expect it to be named")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="gpumon-sdc-example-"))
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    text = Path(__file__).read_bytes()
    model = make_model(d_model=64).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    model.train()
    for step in range(args.train_steps):
        batch = {k: v.to(device) for k, v in batches(text, 8, gen).items()}
        optimizer.zero_grad()
        loss = next_byte_loss(model, batch)
        loss.backward()
        optimizer.step()
        print(f"train step {step}: loss {loss.item():.3f}")

    batch = {k: v.to(device) for k, v in batches(text, 8, gen).items()}
    bundle = gpumon.sdc.capture(out / "bundle", model=model, optimizer=optimizer, batch=batch,
                                loss_fn=next_byte_loss, model_factory=make_model,
                                model_kwargs={"d_model": 64}, seed=1234,
                                watch=("embed", "layers.0", "layers.1", "head"), name="char-transformer")
    manifest = json.loads((bundle / "manifest.json").read_text())
    print(f"captured one training step into {bundle}: {len(manifest['expected']['points'])} tensors "
          f"fingerprinted (loss, {sum(p[0].startswith('grad.') for p in manifest['expected']['points'])} "
          "gradients, optimizer state, updated weights)")

    cmd = [*gpumon_canary(), "run", "--bundle", str(bundle), "--workers", str(args.workers),
           "--device", args.device, "--state-dir", str(out / "state")]
    print("$", " ".join(cmd[1:]))
    healthy = subprocess.run(cmd, timeout=600)
    print(f"healthy replay: exit {healthy.returncode} "
          "(0: every worker bit-exact with the capture and with each other)")
    if healthy.returncode != 0:
        return 1
    if args.demo_fault:
        fault = "worker=1,dtype=float32,rate=0.02,seed=7"
        cmd = [*cmd, "--inject", fault, "--json"]
        print("$", " ".join(cmd[1:]))
        faulty = subprocess.run(cmd, timeout=600, capture_output=True, text=True)
        report = json.loads(faulty.stdout)
        failed = [f for f in report["findings"] if f["severity"] == "fail"]
        for f in failed:
            print(f"{f['component']}: {f['message']}")
        print(f"replay with a faulty worker 1: exit {faulty.returncode}")
        if faulty.returncode != 2 or [f["component"] for f in failed] != ["gpu/1"]:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
