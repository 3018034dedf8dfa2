"""``nn.TransformerEncoder`` with nested tensors: trained three steps (dropout on), then
called in eval mode under no_grad with a key padding mask, which takes PyTorch's fast path
(nested tensors, fused kernels).

The fast path is refused to a layer holding forward hooks or pre-hooks of its own: the
script counts the layers that call its fused kernel. The eval outputs are saved with the
parameters, to be compared bit for bit.

    python tests/transparency/scripts/transformer_fastpath.py /tmp/out.pt
"""
# expect: exit=0 steps=3 roots=TinyEncoder

import sys

import torch
import torch.nn.functional as F
from torch import nn


class TinyEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            d_model=16, nhead=2, dim_feedforward=32, dropout=0.1, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x, padding_mask=None):
        h = self.encoder(x, src_key_padding_mask=padding_mask)  # (batch, seq, 16)
        return self.head(h.mean(dim=1)), h


def main(out: str) -> None:
    torch.manual_seed(0)
    model = TinyEncoder()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = torch.randn(3, 4, 6, 16), torch.randint(0, 3, (3, 4))
    for step in range(3):
        logits, _ = model(x[step])
        loss = F.cross_entropy(logits, y[step])
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")

    model.eval()
    padding_mask = torch.tensor([[False] * 6, [False] * 4 + [True] * 2, [False] * 3 + [True] * 3])
    fused_layer = torch._transformer_encoder_layer_fwd  # what the fast path calls, per layer
    fused_calls = []

    def counted(*args, **kwargs):
        fused_calls.append(1)
        return fused_layer(*args, **kwargs)

    torch._transformer_encoder_layer_fwd = counted
    with torch.no_grad():
        logits, h = model(torch.randn(3, 6, 16), padding_mask)
    torch._transformer_encoder_layer_fwd = fused_layer
    print("layers that took the fast path:", len(fused_calls))
    torch.set_printoptions(precision=4, sci_mode=False)
    print("logits", logits)
    print("encoded, first sequence", h[0, :2])
    print("encoded, padded positions are zero:", bool((h[1, 4:] == 0).all()))
    params = dict(model.state_dict())
    params.update({"eval.logits": logits, "eval.encoded": h})  # compared bit for bit too
    torch.save(params, out)


if __name__ == "__main__":
    main(sys.argv[1])
