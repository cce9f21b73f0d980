"""The zoo's PyTorch models: tiny configurations of transformers' model classes (and one small MobileNetV3-style
CNN written here), with random weights, wrapped so that each takes and returns plain tensors.

Each ``Spec`` says how to build the module, which inputs it takes for given sizes (``feeds``), the sizes it is
exported with and the calls it is checked with, and which variants and optimizer settings apply. Used by
``zoo.py`` (needs torch and transformers: scripts/build_zoo.sh installs them into .venv-zoo).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

VOCAB = 1000
LAYERS = 2

ENCODER_VARIANTS = ("fp32", "fp16", "int8_dynamic", "int8_qdq", "int8_qoperator", "optimized")
CNN_VARIANTS = ("fp32", "fp16", "int8_dynamic", "int8_qdq", "int8_qoperator")
DECODER_VARIANTS = ("fp32", "fp16", "int8_dynamic", "int4", "optimized")


@dataclass
class Feed:
    """One input: its name, numpy dtype, concrete shape, and how its values are made (``fill``):
    ``ids`` (integers in [0, high)), ``ones``, ``zeros``, ``normal`` (standard normal), ``positions``
    (start, start + 1, ... along the last axis). ``axes`` names its dynamic axes; ``group`` is the forward
    argument it belongs to when that argument is a tuple (the past key/values)."""

    name: str
    dtype: str
    shape: list[int]
    fill: str
    axes: dict[int, str] = field(default_factory=dict)
    high: int = 0
    start: int = 0
    group: str = ""

    def describe(self) -> dict:
        out = {"name": self.name, "dtype": self.dtype, "shape": self.shape, "fill": self.fill}
        if self.fill == "ids":
            out["high"] = self.high
        if self.fill == "positions":
            out["start"] = self.start
        return out


@dataclass
class Spec:
    """A model of the zoo. ``feeds(batch, seq, past)`` lists its inputs for those sizes; ``export_dims`` are the
    sizes it is exported with (all distinct and > 1, so no exporter mistakes one size for another or
    specializes it); ``calls`` the representative calls written to the manifest."""

    name: str
    architecture: str
    description: str
    build: Callable[[], nn.Module]
    feeds: Callable[[int, int, int], list[Feed]]
    outputs: Callable[[], list[tuple[str, dict[int, str]]]]  # names and their dynamic axes
    variants: tuple[str, ...]
    calls: dict[str, tuple[int, int, int]]
    export_dims: tuple[int, int, int] = (2, 7, 5)
    optimizer: tuple[str, int, int] | None = None  # model_type, num_heads, hidden_size
    calibration_call: str = "default"
    static_op_types: tuple[str, ...] = ()  # quantize_static's op_types_to_quantize; empty: its default
    notes: str = ""


def jitter(module: nn.Module, seed: int) -> nn.Module:
    """Random non-trivial biases, norm scales and batch-norm statistics (the libraries initialize them to 0 and
    1, which would hide a runtime that ignores them). Returns the module in eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            if param.dim() <= 1:
                param.add_(0.1 * torch.randn(param.shape, generator=gen))
        for sub in module.modules():
            if isinstance(sub, nn.BatchNorm2d):
                sub.running_mean.copy_(0.1 * torch.randn(sub.running_mean.shape, generator=gen))
                sub.running_var.copy_(torch.rand(sub.running_var.shape, generator=gen) + 0.5)
    return module.eval()


# --- encoders -----------------------------------------------------------------------------------------------


class BertWrapper(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import BertConfig, BertModel

        config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                            intermediate_size=128, max_position_embeddings=128, attn_implementation="eager")
        self.model = BertModel(config)

    def forward(self, input_ids, attention_mask, token_type_ids):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return out.last_hidden_state, out.pooler_output


def text_feeds(batch: int, seq: int, _past: int, token_types: bool = True) -> list[Feed]:
    axes = {0: "batch", 1: "sequence"}
    feeds = [Feed("input_ids", "int64", [batch, seq], "ids", axes, high=VOCAB),
             Feed("attention_mask", "int64", [batch, seq], "ones", axes)]
    if token_types:
        feeds.append(Feed("token_type_ids", "int64", [batch, seq], "zeros", axes))
    return feeds


class T5EncoderWrapper(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.encoder = model.get_encoder()

    def forward(self, input_ids, attention_mask):
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def t5_model() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=LAYERS, num_decoder_layers=LAYERS,
                      num_heads=4, relative_attention_num_buckets=8, decoder_start_token_id=0,
                      attn_implementation="eager")
    torch.manual_seed(0)
    return jitter(T5ForConditionalGeneration(config), 0)


# --- vision and audio ----------------------------------------------------------------------------------------


class LogitsWrapper(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        return self.model(pixel_values=pixel_values).logits


def vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=128,
                       image_size=32, patch_size=8, num_labels=10, attn_implementation="eager")
    return LogitsWrapper(ViTForImageClassification(config))


def resnet() -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                          layer_type="bottleneck", num_labels=10)
    return LogitsWrapper(ResNetForImageClassification(config))


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.reduce, self.expand = nn.Conv2d(channels, channels // 4, 1), nn.Conv2d(channels // 4, channels, 1)

    def forward(self, x):
        return x * nn.functional.hardsigmoid(self.expand(torch.relu(self.reduce(self.pool(x)))))


def conv_bn(cin: int, cout: int, kernel: int, stride: int, groups: int, act: nn.Module | None) -> list[nn.Module]:
    layers = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return layers + ([act] if act is not None else [])


class InvertedResidual(nn.Module):
    """MobileNetV3's block: 1x1 expansion, depthwise kxk, squeeze-and-excite, 1x1 projection, residual."""

    def __init__(self, cin: int, expand: int, cout: int, kernel: int, stride: int, se: bool, act: type):
        super().__init__()
        layers = conv_bn(cin, expand, 1, 1, 1, act()) if expand != cin else []
        layers += conv_bn(expand, expand, kernel, stride, expand, act())
        layers += [SqueezeExcite(expand)] if se else []
        layers += conv_bn(expand, cout, 1, 1, 1, None)
        self.body, self.residual = nn.Sequential(*layers), stride == 1 and cin == cout

    def forward(self, x):
        return x + self.body(x) if self.residual else self.body(x)


class MobileNetV3(nn.Module):
    BLOCKS = ((16, 16, 16, 3, 2, True, nn.ReLU), (16, 64, 24, 3, 2, False, nn.ReLU), (24, 72, 24, 3, 1, False, nn.ReLU),
              (24, 96, 40, 5, 2, True, nn.Hardswish), (40, 120, 40, 5, 1, True, nn.Hardswish))

    def __init__(self, classes: int = 10):
        super().__init__()
        blocks = [InvertedResidual(*b) for b in self.BLOCKS]
        self.features = nn.Sequential(*conv_bn(3, 16, 3, 2, 1, nn.Hardswish()), *blocks,
                                      *conv_bn(40, 240, 1, 1, 1, nn.Hardswish()), nn.AdaptiveAvgPool2d(1))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(240, 128), nn.Hardswish(), nn.Dropout(0.2),
                                        nn.Linear(128, classes))

    def forward(self, pixel_values):
        return self.classifier(self.features(pixel_values))


class Fire(nn.Module):
    """SqueezeNet's fire module: a 1x1 squeeze, then 1x1 and 3x3 expansions whose outputs are concatenated."""

    def __init__(self, cin: int, squeeze: int, expand: int):
        super().__init__()
        self.squeeze = nn.Conv2d(cin, squeeze, 1)
        self.expand1, self.expand3 = nn.Conv2d(squeeze, expand, 1), nn.Conv2d(squeeze, expand, 3, padding=1)

    def forward(self, x):
        x = torch.relu(self.squeeze(x))
        return torch.cat([torch.relu(self.expand1(x)), torch.relu(self.expand3(x))], 1)


class SqueezeNet(nn.Module):
    """SqueezeNet 1.1's layout at half width: ceil-mode max pools between pairs of fire modules, a 1x1
    convolution classifier averaged over the map."""

    def __init__(self, classes: int = 10):
        super().__init__()
        pool = lambda: nn.MaxPool2d(3, 2, ceil_mode=True)  # noqa: E731
        self.features = nn.Sequential(nn.Conv2d(3, 32, 3, 2), nn.ReLU(), pool(), Fire(32, 8, 32), Fire(64, 8, 32),
                                      pool(), Fire(64, 16, 64), Fire(128, 16, 64), pool(), Fire(128, 24, 96))
        self.classifier = nn.Sequential(nn.Dropout(0.5), nn.Conv2d(192, classes, 1), nn.ReLU(),
                                        nn.AdaptiveAvgPool2d(1), nn.Flatten())

    def forward(self, pixel_values):
        return self.classifier(self.features(pixel_values))


def image_feeds(size: int) -> Callable[[int, int, int], list[Feed]]:
    return lambda batch, _seq, _past: [Feed("pixel_values", "float32", [batch, 3, size, size], "normal",
                                            {0: "batch"})]


class WhisperEncoderWrapper(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import WhisperConfig, WhisperModel

        config = WhisperConfig(vocab_size=VOCAB, d_model=64, encoder_layers=LAYERS, decoder_layers=1,
                               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                               decoder_ffn_dim=128, num_mel_bins=80, max_source_positions=50,
                               max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                               decoder_start_token_id=3, attn_implementation="eager")
        self.encoder = WhisperModel(config).get_encoder()

    def forward(self, input_features):
        return self.encoder(input_features=input_features).last_hidden_state


def audio_feeds(batch: int, _seq: int, _past: int) -> list[Feed]:
    # Whisper's encoder takes exactly 2 * max_source_positions frames (checked in its forward): only the
    # batch is dynamic.
    return [Feed("input_features", "float32", [batch, 80, 100], "normal", {0: "batch"})]


# --- decoders with past --------------------------------------------------------------------------------------


class CausalLMWithPast(nn.Module):
    """input_ids, attention_mask, position_ids and the past keys/values of every layer (a flat tuple) in;
    logits and the present keys/values out. Past length 0 is the prefill."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, past):
        from transformers import DynamicCache

        cache = DynamicCache([(past[i], past[i + 1]) for i in range(0, len(past), 2)])
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
        presents = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        return (out.logits, *presents)


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=LAYERS, n_head=4,
                        attn_implementation="eager")
    return CausalLMWithPast(GPT2LMHeadModel(config))


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                         attn_implementation="eager")
    return CausalLMWithPast(LlamaForCausalLM(config))


def past_feeds(batch: int, past: int, kv_heads: int, head_dim: int, prefix: str = "past_key_values",
               kinds: tuple[str, ...] = ("",), lengths: tuple[int, ...] | None = None) -> list[Feed]:
    feeds = []
    for layer in range(LAYERS):
        for kind, length in zip(kinds, lengths or (past,) * len(kinds)):
            axis = "past_sequence" if length == past else "encoder_sequence"
            for kv in ("key", "value"):
                name = ".".join(p for p in (prefix, str(layer), kind, kv) if p)
                feeds.append(Feed(name, "float32", [batch, kv_heads, length, head_dim], "normal",
                                  {0: "batch", 2: axis}, group="past"))
    return feeds


def causal_feeds(kv_heads: int, head_dim: int) -> Callable[[int, int, int], list[Feed]]:
    def feeds(batch: int, seq: int, past: int) -> list[Feed]:
        return [Feed("input_ids", "int64", [batch, seq], "ids", {0: "batch", 1: "sequence"}, high=VOCAB),
                Feed("attention_mask", "int64", [batch, past + seq], "ones", {0: "batch", 1: "total_sequence"}),
                Feed("position_ids", "int64", [batch, seq], "positions", {0: "batch", 1: "sequence"}, start=past),
                *past_feeds(batch, past, kv_heads, head_dim)]

    return feeds


def decoder_outputs(kinds: tuple[str, ...] = ("",)) -> list[tuple[str, dict[int, str]]]:
    presents = [".".join(p for p in ("present", str(layer), kind, kv) if p)
                for layer in range(LAYERS) for kind in kinds for kv in ("key", "value")]
    return [("logits", {0: "batch", 1: "sequence"})] + [(name, {0: "batch", 2: "total_sequence"}) for name in presents]


class T5DecoderWithPast(nn.Module):
    """Like optimum's decoder_with_past_model: decoder input_ids, the encoder's attention_mask and the past
    self-attention (past_sequence) and cross-attention (encoder_sequence) keys/values in; logits and the
    present self-attention keys/values out. Past length 0 is the decoder's first step given the cross keys."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, encoder_attention_mask, past):
        from transformers import EncoderDecoderCache

        cache = EncoderDecoderCache([tuple(past[i:i + 4]) for i in range(0, len(past), 4)])
        cross_key = past[2]
        # Only its shape matters: the cross-attention reads the cached keys/values.
        hidden = cross_key.new_zeros(cross_key.shape[0], cross_key.shape[2], self.model.config.d_model)
        out = self.model(decoder_input_ids=input_ids, attention_mask=encoder_attention_mask,
                         encoder_outputs=(hidden,), past_key_values=cache, use_cache=True)
        layers = out.past_key_values.self_attention_cache.layers
        return (out.logits, *[t for layer in layers for t in (layer.keys, layer.values)])


ENCODER_SEQ = 12


def t5_decoder_feeds(batch: int, seq: int, past: int) -> list[Feed]:
    enc = ENCODER_SEQ
    return [Feed("input_ids", "int64", [batch, seq], "ids", {0: "batch", 1: "sequence"}, high=VOCAB),
            Feed("encoder_attention_mask", "int64", [batch, enc], "ones", {0: "batch", 1: "encoder_sequence"}),
            *past_feeds(batch, past, 4, 16, kinds=("decoder", "encoder"), lengths=(past, enc))]


# --- the zoo -------------------------------------------------------------------------------------------------

SEQ_AXES = {0: "batch", 1: "sequence"}
BATCH_AXES = {0: "batch"}
ENCODER_CALLS = {"default": (1, 16, 0)}
DECODER_CALLS = {"prefill": (1, 16, 0), "decode": (1, 1, 16)}


def seeded(build: Callable[[], nn.Module], seed: int = 0) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(seed)
        return jitter(build(), seed)

    return make


def named(*outputs: tuple[str, dict[int, str]]) -> Callable[[], list[tuple[str, dict[int, str]]]]:
    return lambda: list(outputs)


SPECS = [
    Spec("bert", "encoder", "BERT (transformers BertModel), hidden 64, 2 layers, 4 heads, vocab 1000",
         seeded(BertWrapper), text_feeds, named(("last_hidden_state", SEQ_AXES), ("pooler_output", BATCH_AXES)),
         ENCODER_VARIANTS, ENCODER_CALLS, optimizer=("bert", 4, 64)),
    Spec("vit", "vision", "ViT (transformers ViTForImageClassification), 32x32 image, patch 8, hidden 64, 2 layers",
         seeded(vit), image_feeds(32), named(("logits", BATCH_AXES)), ENCODER_VARIANTS, ENCODER_CALLS,
         optimizer=("vit", 4, 64)),
    Spec("resnet", "vision", "ResNet (transformers ResNetForImageClassification), bottleneck, 4 stages x 1 block",
         seeded(resnet), image_feeds(64), named(("logits", BATCH_AXES)), CNN_VARIANTS, ENCODER_CALLS),
    Spec("mobilenetv3", "vision", "MobileNetV3-style CNN (torch): depthwise convs, hardswish, squeeze-and-excite",
         seeded(MobileNetV3), image_feeds(64), named(("logits", BATCH_AXES)), CNN_VARIANTS, ENCODER_CALLS),
    Spec("squeezenet", "vision", "SqueezeNet 1.1-style CNN (torch), half width: fire modules (concatenated 1x1 "
         "and 3x3 expansions), ceil-mode max pools, convolution classifier", seeded(SqueezeNet), image_feeds(64),
         named(("logits", BATCH_AXES)), CNN_VARIANTS, ENCODER_CALLS),
    Spec("whisper_encoder", "audio", "Whisper encoder (transformers): 2 conv1d + GELU front end, 2 layers, d 64, "
         "80 mel bins x 100 frames", seeded(WhisperEncoderWrapper), audio_feeds,
         named(("last_hidden_state", BATCH_AXES)), ENCODER_VARIANTS, ENCODER_CALLS, optimizer=("bart", 4, 64),
         notes="frames fixed at 100 (2 x max_source_positions, checked by the model): only the batch is dynamic"),
    Spec("t5_encoder", "encoder-decoder", "T5 encoder (transformers T5ForConditionalGeneration), d 64, 2 layers",
         lambda: T5EncoderWrapper(t5_model()), lambda b, s, p: text_feeds(b, s, p, token_types=False),
         named(("last_hidden_state", SEQ_AXES)), ENCODER_VARIANTS, ENCODER_CALLS, optimizer=("t5", 4, 64),
         static_op_types=("MatMul",),
         notes="int8 static: MatMul only (quantizing everything also quantizes the relative-position bucket "
               "arithmetic, and the bucket indices run out of range)"),
    Spec("t5_decoder", "encoder-decoder", "T5 decoder with past (self- and cross-attention caches in, self "
         "present out), d 64, 2 layers", lambda: T5DecoderWithPast(t5_model()), t5_decoder_feeds,
         lambda: decoder_outputs(("decoder",)), DECODER_VARIANTS, DECODER_CALLS, optimizer=("t5", 4, 64),
         calibration_call="decode"),
    Spec("gpt2", "decoder", "GPT-2 (transformers GPT2LMHeadModel) with past, n_embd 64, 2 layers, 4 heads",
         seeded(gpt2), causal_feeds(4, 16), decoder_outputs, DECODER_VARIANTS, DECODER_CALLS,
         optimizer=("gpt2", 4, 64), calibration_call="decode"),
    Spec("llama", "decoder", "LLaMA (transformers LlamaForCausalLM) with past, hidden 64, 2 layers, 4 query / 2 KV "
         "heads, RMSNorm, rotary, SwiGLU", seeded(llama), causal_feeds(2, 16), decoder_outputs, DECODER_VARIANTS,
         DECODER_CALLS, optimizer=("gpt2", 4, 64), calibration_call="decode"),
]
