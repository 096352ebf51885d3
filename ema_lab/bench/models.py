"""A model zoo for EMA experiments, built from plain ``torch.nn`` (no torchvision needed).

Sizes are what matters for an EMA update: how many tensors, how many elements. Each builder's
docstring gives the figures that :func:`describe` reports (the tests assert them):

==================  ================  =============  ================  ===========================
name                state_dict keys   float tensors  float elements    resembles
==================  ================  =============  ================  ===========================
``yolo``            708               594            2,600,144         ultralytics yolo26n
``resnet50``        320               267            25,610,152        torchvision resnet50
``gpt2``            144               144            85,054,464        GPT-2 small's 12 blocks
``tiny_tensors``    2,000             2,000          272,000           1000 x Linear(16, 16)
``tiny_cnn``        32                27             11,266            tests, the quick demo
``tiny_transformer``  29              29             21,760            tests (tied embedding)
==================  ================  =============  ================  ===========================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "Conv",
    "yolo",
    "resnet50",
    "gpt2",
    "tiny_tensors",
    "tiny_cnn",
    "tiny_transformer",
    "ZOO",
    "build",
    "describe",
]


class Conv(nn.Module):
    """Conv2d + BatchNorm2d + SiLU, as ultralytics' ``Conv``, with the activation shared at class level.

    Every ``Conv`` ever built holds the *same* ``nn.SiLU`` object: anything a profiler leaves on it
    (thop's float64 buffers) travels into every model built afterwards.
    """

    default_act = nn.SiLU()

    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, k // 2, bias=False)
        self.bn = nn.BatchNorm2d(c2)
        self.act = self.default_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class Bottleneck(nn.Module):
    """Two 3x3 ``Conv`` with a residual connection."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.cv1, self.cv2 = Conv(c, c, 3), Conv(c, c, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.cv2(self.cv1(x))


class C2f(nn.Module):
    """ultralytics' C2f: split, a chain of bottlenecks, concatenate every stage, fuse."""

    def __init__(self, c1: int, c2: int, n: int) -> None:
        super().__init__()
        self.c = c2 // 2
        self.cv1 = Conv(c1, 2 * self.c)
        self.cv2 = Conv((2 + n) * self.c, c2)
        self.m = nn.ModuleList(Bottleneck(self.c) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = list(self.cv1(x).chunk(2, 1))
        for m in self.m:
            y.append(m(y[-1]))
        return self.cv2(torch.cat(y, 1))


class Head(nn.Module):
    """One detection branch per scale: two ``Conv`` then a biased 1x1 ``Conv2d``."""

    def __init__(self, chs: tuple[int, ...], c_mid: int, c_out: int) -> None:
        super().__init__()
        self.branches = nn.ModuleList(
            nn.Sequential(Conv(c, c_mid, 3), Conv(c_mid, c_mid, 3), nn.Conv2d(c_mid, c_out, 1)) for c in chs
        )

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [b(x) for b, x in zip(self.branches, xs)]


class YoloLike(nn.Module):
    """A YOLO-style detector: Conv/C2f backbone, FPN neck, box+class heads, one-to-many and one-to-one."""

    def __init__(self, nc: int = 80) -> None:
        super().__init__()
        # Widths, C2f depths and head widths chosen to match yolo26n's 708 entries / 594 float tensors / 2.6M.
        c0, c1, c2, c3, c4 = 16, 32, 48, 80, 160
        n, mid = (4, 4, 4, 5, 4, 4, 4, 4), (32, 32)
        self.stem = nn.Sequential(Conv(3, c0, 3, 2), Conv(c0, c1, 3, 2), C2f(c1, c1, n[0]))
        self.p3 = nn.Sequential(Conv(c1, c2, 3, 2), C2f(c2, c2, n[1]))
        self.p4 = nn.Sequential(Conv(c2, c3, 3, 2), C2f(c3, c3, n[2]))
        self.p5 = nn.Sequential(Conv(c3, c4, 3, 2), C2f(c4, c4, n[3]), Conv(c4, c4))
        self.up = nn.Upsample(scale_factor=2)
        self.top4 = C2f(c4 + c3, c3, n[4])
        self.top3 = C2f(c3 + c2, c2, n[5])
        self.down4 = Conv(c2, c2, 3, 2)
        self.out4 = C2f(c2 + c3, c3, n[6])
        self.down5 = Conv(c3, c3, 3, 2)
        self.out5 = C2f(c3 + c4, c4, n[7])
        chs = (c2, c3, c4)
        self.box, self.cls = Head(chs, mid[0], 64), Head(chs, mid[1], nc)
        self.box_o2o, self.cls_o2o = Head(chs, mid[0], 64), Head(chs, mid[1], nc)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        x3 = self.p3(self.stem(x))
        x4 = self.p4(x3)
        x5 = self.p5(x4)
        t4 = self.top4(torch.cat([self.up(x5), x4], 1))
        t3 = self.top3(torch.cat([self.up(t4), x3], 1))
        o4 = self.out4(torch.cat([self.down4(t3), t4], 1))
        o5 = self.out5(torch.cat([self.down5(o4), x5], 1))
        feats = [t3, o4, o5]
        heads = (self.box, self.cls, self.box_o2o, self.cls_o2o)
        return [torch.cat(outs, 1) for outs in zip(*(h(feats) for h in heads))]


def yolo() -> nn.Module:
    """YOLO-sized conv net: 708 state_dict entries, 594 float tensors, 2.60M float elements (like yolo26n)."""
    return YoloLike()


class ResNetBottleneck(nn.Module):
    """torchvision's ResNet bottleneck (1x1, 3x3, 1x1, expansion 4)."""

    def __init__(self, cin: int, c: int, stride: int) -> None:
        super().__init__()
        cout = 4 * c
        self.conv1, self.bn1 = nn.Conv2d(cin, c, 1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, stride, 1, bias=False), nn.BatchNorm2d(c)
        self.conv3, self.bn3 = nn.Conv2d(c, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idt = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        return self.relu(self.bn3(self.conv3(y)) + idt)


def resnet50(num_classes: int = 1000) -> nn.Module:
    """ResNet-50 (torchvision layout): 320 entries, 267 float tensors, 25.6M float elements."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = 64
    for c, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(ResNetBottleneck(cin, c, stride if i == 0 else 1))
            cin = 4 * c
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


def gpt2(layers: int = 12, d: int = 768, heads: int = 12) -> nn.Module:
    """GPT-2-small-sized transformer blocks (no embeddings): 144 float tensors, 85.1M elements."""
    block = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
    return nn.TransformerEncoder(block, layers, enable_nested_tensor=False)


def tiny_tensors(n: int = 1000, width: int = 16) -> nn.Module:
    """Many tiny tensors, the launch-bound extreme: 1000 x Linear(16, 16), 2000 tensors, 272k elements."""
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(n)))


def tiny_cnn(num_classes: int = 10) -> nn.Module:
    """A small Conv+BN+SiLU classifier for tests and demos: 32 entries, 27 float tensors, 11,266 elements."""
    return nn.Sequential(
        Conv(3, 8, 3, 2),
        Conv(8, 16, 3, 2),
        Bottleneck(16),
        Conv(16, 32, 3, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, num_classes),
    )


class TinyTransformer(nn.Module):
    """A 2-block causal-free language model with its output head tied to the token embedding."""

    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(16, d))
        block = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor under two state_dict keys

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.norm(self.blocks(x)))


def tiny_transformer() -> nn.Module:
    """A tiny transformer LM with a tied head: 29 keys, 29 float tensors (28 distinct), 21,760 elements."""
    return TinyTransformer()


ZOO: dict[str, Callable[[], nn.Module]] = {
    "yolo": yolo,
    "resnet50": resnet50,
    "gpt2": gpt2,
    "tiny_tensors": tiny_tensors,
    "tiny_cnn": tiny_cnn,
    "tiny_transformer": tiny_transformer,
}


def build(name: str, seed: int = 0) -> nn.Module:
    """Build zoo model ``name`` with deterministic weights."""
    if name not in ZOO:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(ZOO)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ZOO[name]()


@dataclass(frozen=True)
class ModelStats:
    """What an EMA update of a model touches."""

    entries: int  # state_dict keys
    float_tensors: int  # floating-point state_dict entries (what the seed's loop visits)
    float_elements: int
    float_bytes: int


def describe(model: nn.Module) -> ModelStats:
    """Count a model's state_dict entries and floating-point tensors, elements and bytes."""
    sd = model.state_dict()
    floats = [v for v in sd.values() if v.is_floating_point()]
    return ModelStats(
        entries=len(sd),
        float_tensors=len(floats),
        float_elements=sum(v.numel() for v in floats),
        float_bytes=sum(v.numel() * v.element_size() for v in floats),
    )
