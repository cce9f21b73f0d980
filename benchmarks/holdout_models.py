"""The holdout set: architectures the zoo does not hold and no speed work was tuned on (issues 19 and 20), made
as the zoo's are (tiny transformers configurations, random weights, the zoo's feeds and wrappers) so that
``zoo.py --holdout`` exports and converts them with the zoo's machinery into benchmarks/.models/holdout, and
tests/cpu/test_zoo.py (``ONNX_RUNTIME_ZOO``) and zoo_bench.py (``--zoo``) run them unchanged.

Each brings spellings the zoo lacks: DistilBERT (its own masked_fill of the scores), DeBERTa-v2 (disentangled
relative-position attention), ConvNeXt (7x7 depthwise convolutions, channels-last LayerNorm, layer scale),
GoogLeNet-style Inception blocks (four concatenated branches, one of them a max pool), DenseNet-style dense blocks
(pre-activation batch norms, each layer's output concatenated behind its input),
wav2vec2 (strided conv1d front end with GroupNorm, grouped positional convolution), BART (encoder-decoder in one
call), Phi-3 (fused QKV and gate-up projections) and Gemma (GELU-tanh gate, scaled embeddings, 1 + w RMSNorm).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from zoo_models import (
    DECODER_CALLS,
    ENCODER_CALLS,
    LAYERS,
    SEQ_AXES,
    VOCAB,
    CausalLMWithPast,
    Feed,
    LogitsWrapper,
    Spec,
    causal_feeds,
    decoder_outputs,
    image_feeds,
    named,
    seeded,
    text_feeds,
)

VARIANTS = ("fp32", "fp16", "int8_dynamic")
SMALL = dict(num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=128)


class HiddenStates(nn.Module):
    """An encoder that takes ``input_ids`` and ``attention_mask`` and returns its last hidden state."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def distilbert() -> nn.Module:
    from transformers import DistilBertConfig, DistilBertModel

    config = DistilBertConfig(vocab_size=VOCAB, dim=64, n_layers=LAYERS, n_heads=4, hidden_dim=128,
                              max_position_embeddings=128, attn_implementation="eager")
    return HiddenStates(DistilBertModel(config))


def deberta_v2() -> nn.Module:
    from transformers import DebertaV2Config, DebertaV2Model

    config = DebertaV2Config(vocab_size=VOCAB, hidden_size=64, max_position_embeddings=128, type_vocab_size=0,
                             relative_attention=True, position_buckets=32, pos_att_type=["p2c", "c2p"],
                             max_relative_positions=-1, **SMALL)
    return HiddenStates(DebertaV2Model(config))


def convnext() -> nn.Module:
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = ConvNextConfig(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], num_labels=10)
    return LogitsWrapper(ConvNextForImageClassification(config))


def conv_bn_relu(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Sequential:
    """torchvision's BasicConv2d: a convolution without bias, batch norm, ReLU."""
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU())


class InceptionBlock(nn.Module):
    """GoogLeNet's block: 1x1, 1x1 -> 3x3, 1x1 -> 3x3 -> 3x3 and 3x3 max pool -> 1x1 branches, concatenated."""

    def __init__(self, cin: int, one: int, reduce3: int, three: int, reduce5: int, five: int, pooled: int):
        super().__init__()
        self.b1 = conv_bn_relu(cin, one, 1)
        self.b2 = nn.Sequential(conv_bn_relu(cin, reduce3, 1), conv_bn_relu(reduce3, three, 3))
        self.b3 = nn.Sequential(conv_bn_relu(cin, reduce5, 1), conv_bn_relu(reduce5, five, 3),
                                conv_bn_relu(five, five, 3))
        self.b4 = nn.Sequential(nn.MaxPool2d(3, 1, 1), conv_bn_relu(cin, pooled, 1))

    def forward(self, x):
        return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], 1)


class Inception(nn.Module):
    """A GoogLeNet-style CNN at a fraction of the width: stem, two Inception blocks, a pool, a third, the head."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            conv_bn_relu(3, 24, 5, 2), nn.MaxPool2d(3, 2, 1), conv_bn_relu(24, 32, 1), conv_bn_relu(32, 48, 3),
            nn.MaxPool2d(3, 2, 1), InceptionBlock(48, 16, 24, 32, 8, 8, 8), InceptionBlock(64, 24, 24, 40, 8, 16, 16),
            nn.MaxPool2d(3, 2, 1), InceptionBlock(96, 32, 24, 48, 8, 16, 16), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(112, classes)

    def forward(self, pixel_values):
        return self.classifier(self.features(pixel_values))


class DenseLayer(nn.Module):
    """DenseNet's layer: BN -> ReLU -> 1x1 -> BN -> ReLU -> 3x3, its growth concatenated behind its input."""

    def __init__(self, cin: int, growth: int):
        super().__init__()
        self.body = nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(), nn.Conv2d(cin, 4 * growth, 1, bias=False),
                                  nn.BatchNorm2d(4 * growth), nn.ReLU(), nn.Conv2d(4 * growth, growth, 3, 1, 1,
                                                                                   bias=False))

    def forward(self, x):
        return torch.cat([x, self.body(x)], 1)


class DenseNet(nn.Module):
    """A DenseNet-style CNN: pre-activation dense blocks of three layers (growth 8) and a transition between."""

    def __init__(self, classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                                   nn.MaxPool2d(3, 2, 1)]
        channels = 16
        for block in range(2):
            for _ in range(3):
                layers.append(DenseLayer(channels, 8))
                channels += 8
            if block == 0:  # transition: BN -> ReLU -> 1x1 halving the channels -> 2x2 average pool
                layers += [nn.BatchNorm2d(channels), nn.ReLU(), nn.Conv2d(channels, channels // 2, 1, bias=False),
                           nn.AvgPool2d(2, 2)]
                channels //= 2
        layers += [nn.BatchNorm2d(channels), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels, classes)

    def forward(self, pixel_values):
        return self.classifier(self.features(pixel_values))


class AudioHiddenStates(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_values):
        return self.model(input_values=input_values).last_hidden_state


def wav2vec2() -> nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    config = Wav2Vec2Config(hidden_size=64, conv_dim=(32, 32, 32), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
                            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, feat_extract_norm="group",
                            attn_implementation="eager", **SMALL)
    return AudioHiddenStates(Wav2Vec2Model(config))


SAMPLES_PER_STEP = 100  # audio samples per unit of the spec's sequence size: a call of 16 is 1600 samples


def audio_feeds(batch: int, seq: int, _past: int) -> list[Feed]:
    return [Feed("input_values", "float32", [batch, SAMPLES_PER_STEP * seq], "normal", {0: "batch", 1: "samples"})]


class Seq2SeqLogits(nn.Module):
    """Encoder and decoder in one call (no cache): source ids and mask, decoder ids in; logits out."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, decoder_input_ids):
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          decoder_input_ids=decoder_input_ids).logits


def bart() -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=LAYERS, decoder_layers=LAYERS,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                        decoder_ffn_dim=128, max_position_embeddings=128, attn_implementation="eager")
    return Seq2SeqLogits(BartForConditionalGeneration(config))


def seq2seq_feeds(batch: int, seq: int, past: int) -> list[Feed]:
    # The decoder's length differs from the source's so that no exporter takes one for the other.
    return [*text_feeds(batch, seq, past, token_types=False),
            Feed("decoder_input_ids", "int64", [batch, max(1, seq - 3)], "ids", {0: "batch", 1: "target"},
                 high=VOCAB)]


def phi3() -> nn.Module:
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(vocab_size=VOCAB, hidden_size=64, num_key_value_heads=2, max_position_embeddings=128,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="eager", **SMALL)
    return CausalLMWithPast(Phi3ForCausalLM(config))


def gemma() -> nn.Module:
    from transformers import GemmaConfig, GemmaForCausalLM

    config = GemmaConfig(vocab_size=VOCAB, hidden_size=64, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=128, attn_implementation="eager", **SMALL)
    return CausalLMWithPast(GemmaForCausalLM(config))


def encoder(name: str, description: str, build: Callable[[], nn.Module]) -> Spec:
    return Spec(name, "encoder", description, seeded(build), lambda b, s, p: text_feeds(b, s, p, token_types=False),
                named(("last_hidden_state", SEQ_AXES)), VARIANTS, ENCODER_CALLS)


def decoder(name: str, description: str, build: Callable[[], nn.Module]) -> Spec:
    return Spec(name, "decoder", description, seeded(build), causal_feeds(2, 16), decoder_outputs, VARIANTS,
                DECODER_CALLS, calibration_call="decode")


HOLDOUT_SPECS = [
    encoder("distilbert", "DistilBERT (transformers DistilBertModel), dim 64, 2 layers, 4 heads", distilbert),
    encoder("deberta_v2", "DeBERTa-v2 (transformers DebertaV2Model), hidden 64, 2 layers, c2p/p2c relative "
            "attention over 32 position buckets", deberta_v2),
    Spec("convnext", "vision", "ConvNeXt (transformers ConvNextForImageClassification), 4 stages, 7x7 depthwise",
         seeded(convnext), image_feeds(64), named(("logits", {0: "batch"})), VARIANTS, ENCODER_CALLS),
    Spec("inception", "vision", "GoogLeNet-style CNN (torch): Inception blocks of four branches (a max-pool branch "
         "among them) concatenated, conv + batch norm + ReLU", seeded(Inception), image_feeds(64),
         named(("logits", {0: "batch"})), VARIANTS, ENCODER_CALLS),
    Spec("densenet", "vision", "DenseNet-style CNN (torch): pre-activation dense layers (BN -> ReLU -> conv) whose "
         "outputs grow the concatenation, a transition with average pooling", seeded(DenseNet), image_feeds(64),
         named(("logits", {0: "batch"})), VARIANTS, ENCODER_CALLS),
    Spec("wav2vec2", "audio", "wav2vec2 (transformers Wav2Vec2Model): 3 conv1d front end with GroupNorm, grouped "
         "positional conv, 2 layers, hidden 64; 100 samples per sequence step", seeded(wav2vec2), audio_feeds,
         named(("last_hidden_state", {0: "batch", 1: "frames"})), VARIANTS, ENCODER_CALLS),
    Spec("bart", "encoder-decoder", "BART (transformers BartForConditionalGeneration), d 64, 2 + 2 layers, one call "
         "without cache", seeded(bart), seq2seq_feeds, named(("logits", {0: "batch", 1: "target"})), VARIANTS,
         ENCODER_CALLS),
    decoder("phi3", "Phi-3 (transformers Phi3ForCausalLM) with past, hidden 64, 2 layers, 4 query / 2 KV heads, "
            "fused QKV and gate-up", phi3),
    decoder("gemma", "Gemma (transformers GemmaForCausalLM) with past, hidden 64, 2 layers, 4 query / 2 KV heads, "
            "GELU-tanh gate", gemma),
]
