"""A model whose forward pass branches on an example's values (Hugging Face's SDPA attention on a 2-D attention_mask)
cannot be traced per example by vmap: the user gets one clear error naming the fix, and the fix (eager attention)
gives the gradient dot products of an explicit backward loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from influence_core import ConfigError, IdentityInfluence
from influence_core.task import LanguageModelling

transformers = pytest.importorskip("transformers", reason="transformers is in the dev extra")


class Named(nn.Module):
    """GPT-2 called with named fields, as a dataset's input_ids and attention_mask reach it."""

    def __init__(self, attention: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0, attn_implementation=attention)
        self.gpt = transformers.GPT2LMHeadModel(config).double().eval()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.gpt(input_ids=input_ids, attention_mask=attention_mask).logits


def batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    ids = torch.randint(0, 32, (5, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0  # one padded example
    return {"input_ids": ids, "attention_mask": mask}, ids


def test_sdpa_attention_mask_is_refused_with_the_fix():
    x, y = batch()
    with pytest.raises(ConfigError, match='attn_implementation="eager"') as caught:
        IdentityInfluence(Named("sdpa"), LanguageModelling()).fit((x, y)).influences(x, y, x, y)
    assert caught.value.field == "model"


def test_eager_attention_scores_equal_a_backward_loop():
    x, y = batch()
    model = Named("eager")
    scores = IdentityInfluence(model, LanguageModelling()).fit((x, y)).influences(x, y, x, y)
    task, params = LanguageModelling(), [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(len(y)):
        one = {k: v[i : i + 1] for k, v in x.items()}
        loss = task.mean_loss(task.output(model(**one)), y[i : i + 1])
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    grads = torch.stack(rows)
    torch.testing.assert_close(scores, grads @ grads.T, rtol=1e-9, atol=1e-12)
