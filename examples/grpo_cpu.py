"""A GRPO-style policy update with hugehead on the CPU: the policy's per-token log-probabilities and entropy,
a frozen reference head's log-probabilities and the clipped ratio loss — the vocabulary streamed, never the
``tokens × V`` logits of the update.

    python examples/grpo_cpu.py                      # 30 steps, 4096 tokens of vocabulary, two CPU shards
    python examples/grpo_cpu.py --steps 60 --vocab 50000

The task: a prompt is an id; the policy (an embedding of (prompt, position) through a small MLP, then a
:class:`hugehead.ChunkedClassifier` over the vocabulary) writes ``--length`` tokens, and the reward of a
completion is the fraction of its tokens in a "good" set (every 7th id). Each step samples ``--group``
completions per prompt from the current policy (rollouts; a real trainer takes them from its inference
engine — this example samples from the full softmax of its small batch, outside the update), scores them,
normalizes the rewards within each group (GRPO's advantages), and takes ``--epochs`` optimizer steps on

    loss = -mean(min(r A, clip(r, 1 - eps, 1 + eps) A)) + beta * KL(policy || reference) - c * entropy

with ``r = exp(log p - log p_old)`` per token, ``KL`` the k3 estimator ``exp(q) - q - 1`` of
``q = log p_ref - log p``, and the entropy of the policy's softmax at each token (``head.log_prob(...,
return_entropy=True)``: both differentiable). The reference head is a frozen copy of the initial head; its
log-probabilities come from the same call under ``torch.no_grad()``. The mean reward climbs from about 1/7 towards 1.
"""
from __future__ import annotations

import argparse
import copy
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor, nn

import hugehead


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--length", type=int, default=6, help="tokens per completion")
    p.add_argument("--epochs", type=int, default=2, help="optimizer steps per batch of rollouts")
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--beta", type=float, default=0.02, help="weight of the KL to the reference head")
    p.add_argument("--entropy-bonus", type=float, default=0.001)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class Policy(nn.Module):
    """Features of (prompt, position) -> a head over the vocabulary in two CPU shards."""

    def __init__(self, prompts: int, length: int, dim: int, vocab: int):
        super().__init__()
        self.length = length
        self.embed = nn.Embedding(prompts * length, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.head = hugehead.ChunkedClassifier(dim, vocab, devices=["cpu", "cpu"])

    def features(self, prompt: Tensor) -> Tensor:
        """``[B, L, dim]`` for prompts ``[B]``."""
        position = torch.arange(self.length)
        return self.mlp(self.embed(prompt[:, None] * self.length + position))


def reward(tokens: Tensor) -> Tensor:
    """``[B]``: the fraction of a completion's tokens in the good set."""
    return (tokens % 7 == 0).double().mean(dim=1)


@torch.no_grad()
def rollout(policy: Policy, prompt: Tensor, group: int, temperature: float, generator: torch.Generator):
    """``group`` completions ``[B * group, L]`` per prompt, sampled from the current policy."""
    prompt = prompt.repeat_interleave(group)
    feats = policy.features(prompt)
    weight = torch.cat([s.weight for s in policy.head.shards])
    bias = torch.cat([s.bias for s in policy.head.shards])
    probs = torch.softmax((feats @ weight.T + bias) / temperature, dim=-1)
    tokens = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator).view(feats.shape[:2])
    return prompt, tokens


def grpo_loss(policy: Policy, ref_head, prompt: Tensor, tokens: Tensor, old_logp: Tensor, advantage: Tensor,
              args) -> Dict[str, Tensor]:
    feats = policy.features(prompt)
    logp, entropy = policy.head.log_prob(feats, tokens, temperature=args.temperature, return_entropy=True)
    with torch.no_grad():
        ref_logp = ref_head.log_prob(feats, tokens, temperature=args.temperature)
    ratio = torch.exp(logp - old_logp)
    a = advantage[:, None]
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - args.clip, 1 + args.clip) * a)
    q = ref_logp - logp
    kl = torch.exp(q) - q - 1
    loss = -surrogate.mean() + args.beta * kl.mean() - args.entropy_bonus * entropy.mean()
    return dict(loss=loss, kl=kl.mean().detach(), entropy=entropy.mean().detach())


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, List[float]]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed + 1)
    policy = Policy(args.prompts, args.length, args.dim, args.vocab)
    ref_head = copy.deepcopy(policy.head).requires_grad_(False)
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    history: Dict[str, List[float]] = {"reward": [], "kl": [], "entropy": []}
    for step in range(args.steps):
        prompt, tokens = rollout(policy, torch.arange(args.prompts), args.group, args.temperature, generator)
        rewards = reward(tokens).view(args.prompts, args.group)
        advantage = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1)
        with torch.no_grad():
            old_logp = policy.head.log_prob(policy.features(prompt), tokens, temperature=args.temperature)
        for _ in range(args.epochs):
            out = grpo_loss(policy, ref_head, prompt, tokens, old_logp, advantage.float(), args)
            opt.zero_grad()
            out["loss"].backward()
            opt.step()
        history["reward"].append(float(rewards.mean()))
        history["kl"].append(float(out["kl"]))
        history["entropy"].append(float(out["entropy"]))
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  reward {history['reward'][-1]:.3f}  KL {history['kl'][-1]:.4f}  "
                  f"entropy {history['entropy'][-1]:.3f}", flush=True)
    return history


if __name__ == "__main__":
    main()
