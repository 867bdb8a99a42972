"""Training smoke test on CPU: a tiny two-layer causal transformer trained for 100 steps through
`ioattn.flash_attn_func`'s autograd (on CPU tensors: the tiled torch forward and the recomputing backward)
ends where the same model trained with PyTorch's SDPA ends."""

import pytest
import torch
import torch.nn.functional as F

import ioattn

VOCAB, WIDTH, HEADS, LAYERS, SEQ, BATCH, STEPS = 16, 32, 2, 2, 24, 16, 100


class Block(torch.nn.Module):
    def __init__(self, use_ioattn: bool):
        super().__init__()
        self.use_ioattn = use_ioattn
        self.norm1, self.norm2 = torch.nn.LayerNorm(WIDTH), torch.nn.LayerNorm(WIDTH)
        self.qkv, self.proj = torch.nn.Linear(WIDTH, 3 * WIDTH), torch.nn.Linear(WIDTH, WIDTH)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, HEADS, WIDTH // HEADS).unbind(2)
        if self.use_ioattn:
            attn = ioattn.flash_attn_func(q, k, v, causal=True)
        else:
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True).transpose(1, 2)
        x = x + self.proj(attn.reshape(batch, seq, WIDTH))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(torch.nn.Module):
    def __init__(self, use_ioattn: bool):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.pos = torch.nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(use_ioattn) for _ in range(LAYERS))
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def sequences(generator):
    """Next token = sum of the previous two mod VOCAB: learnable only by looking back through attention."""
    tokens = torch.empty(BATCH, SEQ, dtype=torch.long)
    tokens[:, :2] = torch.randint(0, VOCAB, (BATCH, 2), generator=generator)
    for t in range(2, SEQ):
        tokens[:, t] = (tokens[:, t - 1] + tokens[:, t - 2]) % VOCAB
    return tokens


def train(use_ioattn: bool) -> list[float]:
    torch.manual_seed(0)
    model = TinyTransformer(use_ioattn)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        tokens = sequences(data)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.fixture
def one_thread():
    """Tiny ops: intra-op threads only add overhead, and on a shared 2-core machine they make it 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_training_matches_sdpa(one_thread):
    ours, sdpa = train(use_ioattn=True), train(use_ioattn=False)
    assert ours[-1] < 0.7 * ours[0], "the model should learn"
    first_gap = abs(ours[1] - sdpa[1]) / sdpa[1]
    final_gap = abs(sum(ours[-10:]) - sum(sdpa[-10:])) / sum(sdpa[-10:])
    assert first_gap < 1e-5 and final_gap < 1e-3, (first_gap, final_gap)
