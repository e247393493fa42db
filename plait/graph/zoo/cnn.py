"""Convolutional nets: ResNet-50 (He et al. 2016, v1.5 as torchvision), VGG-16 and VGG-19 (Simonyan & Zisserman 2015).

Each OpGraph layer is a module marked ``plait_layer = "none"`` (replicated under tensor
parallelism, which these nets do not use):

* resnet50: ``stem`` (7x7 conv, BN, ReLU, max-pool), ``layers.0 .. layers.15`` (one per
  bottleneck block, [3, 4, 6, 3] per stage), ``head`` (global average pool + fc).
* vgg16 / vgg19: ``blocks.0 .. blocks.4`` (one per conv block: 2, 2, 3, 3, 3 convs + max-pool for
  VGG-16, configuration D; 2, 2, 4, 4, 4 for VGG-19, configuration E), ``fc6`` (adaptive average
  pool to ``pool`` x ``pool``, fc, ReLU, dropout), ``fc7``, ``fc8``.

``width`` scales every channel count (64 = the paper), ``image`` the input side, so tests can
train a tiny version of the same graph. Parameter counts: 25,557,032, 138,357,544 and 143,667,240
(torchvision's resnet50, vgg16 and vgg19).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plait.graph.zoo.layers import Dropout
from plait.graph.zoo.registry import ModelEntry, ModelSpec, ModelSpecError, Param, register

# ----------------------------------------------------------------------------- ResNet


def _bn(c: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(c)


class Stem(nn.Module):
    plait_layer = "none"

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn = _bn(width)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.pool(F.relu(self.bn(self.conv(x))))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carries the stride, v1.5), 1x1 expand x4; projection shortcut when shapes change."""

    plait_layer = "none"
    expansion = 4

    def __init__(self, in_ch: int, mid: int, stride: int) -> None:
        super().__init__()
        out = mid * self.expansion
        self.conv1 = nn.Conv2d(in_ch, mid, 1, bias=False)
        self.bn1 = _bn(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, stride=stride, padding=1, bias=False)
        self.bn2 = _bn(mid)
        self.conv3 = nn.Conv2d(mid, out, 1, bias=False)
        self.bn3 = _bn(out)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_ch != out:
            self.downsample = nn.Sequential(nn.Conv2d(in_ch, out, 1, stride=stride, bias=False), _bn(out))

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(self.bn3(self.conv3(y)) + identity)


class ClassifierHead(nn.Module):
    plait_layer = "none"

    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class ResNet(nn.Module):
    def __init__(self, blocks: list[int], width: int, classes: int) -> None:
        super().__init__()
        self.stem = Stem(width)
        layers: list[nn.Module] = []
        in_ch = width
        for stage, n in enumerate(blocks):
            mid = width * 2**stage
            for i in range(n):
                layers.append(Bottleneck(in_ch, mid, stride=2 if (i == 0 and stage > 0) else 1))
                in_ch = mid * Bottleneck.expansion
        self.layers = nn.ModuleList(layers)
        self.head = ClassifierHead(in_ch, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@torch.no_grad()
def init_resnet(model: nn.Module) -> None:
    """torchvision's ResNet init: Kaiming-normal (fan_out) convs, BN weight 1 / bias 0."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def resnet_param_count(cfg: dict[str, Any]) -> int:
    w, classes = cfg["width"], cfg["classes"]
    total = 3 * w * 49 + 2 * w  # stem conv + BN
    in_ch = w
    for stage, n in enumerate(cfg["blocks"]):
        mid = w * 2**stage
        out = 4 * mid
        for i in range(n):
            total += in_ch * mid + 9 * mid * mid + mid * out + 2 * (mid + mid + out)
            if i == 0 and (stage > 0 or in_ch != out):
                total += in_ch * out + 2 * out  # projection shortcut + BN
            in_ch = out
    return total + in_ch * classes + classes


def _int_list(value: Any, key: str) -> list[int]:
    if isinstance(value, list | tuple):
        items = list(value)
    else:
        try:
            items = [int(v) for v in str(value).replace("x", "-").split("-")]
        except ValueError:
            raise ModelSpecError(f"{key}={value!r} is not a dash-separated list of integers, e.g. 3-4-6-3") from None
    if not items or any(not isinstance(v, int) or v < 1 for v in items):
        raise ModelSpecError(f"{key}={value!r} must list positive integers, e.g. 3-4-6-3")
    return items


def _check_image(cfg: dict[str, Any], min_image: int) -> None:
    for key in ("width", "classes", "image"):
        if cfg[key] < 1:
            raise ModelSpecError(f"{key} must be >= 1, got {cfg[key]}")
    if cfg["image"] < min_image:
        raise ModelSpecError(f"image={cfg['image']} is too small; this network needs >= {min_image} pixels")


def image_batch(image: int, classes: int) -> Any:
    def make(batch: int, gen: torch.Generator, dtype: torch.dtype) -> tuple[tuple[Tensor], Tensor]:
        x = torch.randn(batch, 3, image, image, generator=gen).to(dtype)
        return (x,), torch.randint(0, classes, (batch,), generator=gen)

    return make


def make_resnet(cfg: dict[str, Any]) -> ModelSpec:
    cfg = dict(cfg)
    cfg["blocks"] = _int_list(cfg["blocks"], "blocks")
    _check_image(cfg, 32)
    cfg.update(family="cnn", layers=sum(cfg["blocks"]))
    return ModelSpec(
        name="resnet50",
        config=cfg,
        construct=lambda: ResNet(cfg["blocks"], cfg["width"], cfg["classes"]),
        make_batch=image_batch(cfg["image"], cfg["classes"]),
        loss_fn=F.cross_entropy,
        init=init_resnet,
        param_formula=lambda: resnet_param_count(cfg),
        description="ResNet-50 v1.5, one layer per bottleneck block",
    )


register(
    ModelEntry(
        name="resnet50",
        description="ResNet-50 v1.5 (224x224, 1000 classes); blocks/width/image configurable",
        params={
            "blocks": Param(str, "3-4-6-3", "bottleneck blocks per stage (dash-separated)"),
            "width": Param(int, 64, "stem / first-stage channels"),
            "image": Param(int, 224, "input image side in pixels"),
            "classes": Param(int, 1000, "output classes"),
        },
        make=make_resnet,
    )
)

# ----------------------------------------------------------------------------- VGG

VGG16_BLOCKS = ((2, 64), (2, 128), (3, 256), (3, 512), (3, 512))  # configuration D
VGG19_BLOCKS = ((2, 64), (2, 128), (4, 256), (4, 512), (4, 512))  # configuration E
VGG_BLOCKS = {"vgg16": VGG16_BLOCKS, "vgg19": VGG19_BLOCKS}


class ConvBlock(nn.Module):
    plait_layer = "none"

    def __init__(self, in_ch: int, out_ch: int, convs: int) -> None:
        super().__init__()
        self.convs = nn.ModuleList(
            nn.Conv2d(in_ch if i == 0 else out_ch, out_ch, 3, padding=1) for i in range(convs)
        )
        self.pool = nn.MaxPool2d(2, stride=2)

    def forward(self, x: Tensor) -> Tensor:
        for conv in self.convs:
            x = F.relu(conv(x))
        return self.pool(x)


class FC(nn.Module):
    """One classifier layer: [adaptive pool + flatten] -> Linear -> [ReLU -> dropout]."""

    plait_layer = "none"

    def __init__(self, in_f: int, out_f: int, dropout: float, pool: int = 0, last: bool = False) -> None:
        super().__init__()
        self.pool = pool
        self.last = last
        self.fc = nn.Linear(in_f, out_f)
        self.drop = Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        if self.pool:
            x = torch.flatten(F.adaptive_avg_pool2d(x, self.pool), 1)
        x = self.fc(x)
        return x if self.last else self.drop(F.relu(x))


class VGG(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        scale, blocks, in_ch = cfg["width"] / 64, [], 3
        for convs, ch in VGG_BLOCKS[cfg["variant"]]:
            out_ch = max(1, round(ch * scale))
            blocks.append(ConvBlock(in_ch, out_ch, convs))
            in_ch = out_ch
        self.blocks = nn.ModuleList(blocks)
        fc, p = cfg["fc"], cfg["pool"]
        self.fc6 = FC(in_ch * p * p, fc, cfg["dropout"], pool=p)
        self.fc7 = FC(fc, fc, cfg["dropout"])
        self.fc8 = FC(fc, cfg["classes"], 0.0, last=True)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.fc8(self.fc7(self.fc6(x)))


def vgg_param_count(cfg: dict[str, Any]) -> int:
    scale, in_ch, total = cfg["width"] / 64, 3, 0
    for convs, ch in VGG_BLOCKS[cfg["variant"]]:
        out_ch = max(1, round(ch * scale))
        total += 9 * in_ch * out_ch + out_ch + (convs - 1) * (9 * out_ch * out_ch + out_ch)
        in_ch = out_ch
    fc, classes = cfg["fc"], cfg["classes"]
    return total + (in_ch * cfg["pool"] ** 2 + 1) * fc + (fc + 1) * fc + (fc + 1) * classes


def make_vgg(cfg: dict[str, Any], variant: str = "vgg16") -> ModelSpec:
    cfg = dict(cfg)
    _check_image(cfg, 32)
    for key in ("fc", "pool"):
        if cfg[key] < 1:
            raise ModelSpecError(f"{key} must be >= 1, got {cfg[key]}")
    if not 0.0 <= cfg["dropout"] < 1.0:
        raise ModelSpecError(f"dropout must be in [0, 1), got {cfg['dropout']}")
    cfg.update(family="cnn", layers=len(VGG_BLOCKS[variant]) + 3)
    return ModelSpec(
        name=variant,
        config=cfg,
        construct=lambda: VGG({**cfg, "variant": variant}),
        make_batch=image_batch(cfg["image"], cfg["classes"]),
        loss_fn=F.cross_entropy,
        param_formula=lambda: vgg_param_count({**cfg, "variant": variant}),
        description=f"{variant.upper()}, one layer per conv block and per fully connected layer",
    )


def _vgg_params() -> dict[str, Param]:
    return {
        "width": Param(int, 64, "channels of the first conv block (64 = paper; others scale)"),
        "fc": Param(int, 4096, "width of fc6 and fc7"),
        "image": Param(int, 224, "input image side in pixels"),
        "pool": Param(int, 7, "adaptive average pool side before fc6"),
        "classes": Param(int, 1000, "output classes"),
        "dropout": Param(float, 0.5, "classifier dropout"),
    }


register(
    ModelEntry(
        name="vgg16",
        description="VGG-16 (224x224, 1000 classes); width/fc/image/pool configurable",
        params=_vgg_params(),
        make=make_vgg,
    )
)

register(
    ModelEntry(
        name="vgg19",
        description="VGG-19 (configuration E: 16 convs + 3 fc; 224x224, 1000 classes), as HAP evaluates",
        params=_vgg_params(),
        make=lambda cfg: make_vgg(cfg, "vgg19"),
    )
)
