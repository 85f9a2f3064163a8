"""Real architectures from ``transformers``, built from small configs (nothing downloaded).

The zoo (``hotswap.tools.zoo``) is our own code; the corpus is what users bring: vision, text, speech
and multimodal models whose graphs use what real models use (max-pooling, stochastic depth,
rotary embeddings, grouped-query attention, relative position buckets, convolutional feature
extractors). Each entry builds a ``Workload`` — the same record stress runs, benchmarks and
profiles take — with a CPU size and a CUDA size, and an eager twin with identical weights as the
reference. ``train=True`` (vision and decoder models) serves forward and backward with every
dropout, stochastic-depth and layer-drop probability at 0, and checks the gradients too.

    >>> w = make("resnet", device="cpu")
    >>> compiled = hotswap.compile(w.target)
    >>> w.error(compiled(*w.inputs(0)), 0)  # max abs error vs eager

The zoo takes these as ``corpus:NAME`` (``zoo.make("corpus:resnet")``), so ``hotswap stress``,
``hotswap bench`` and ``hotswap profile --model`` serve them too.

Needs the ``models`` extra (``pip install -e .[models]``).
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hotswap.tools.common import Workload, tolerance

__all__ = ["MODELS", "TRAINABLE", "Spec", "make"]


@dataclass(frozen=True)
class Spec:
    """One architecture: its config and model classes, the config for each device, and what
    it is fed (``image``, ``tokens``, ``seq2seq``, ``audio`` or ``mel``)."""

    config: str
    model: str
    inputs: str
    cpu: dict[str, Any]
    cuda: dict[str, Any]
    trainable: bool = False


_SMALL_CNN = {"num_channels": 3}
_BERT_CPU = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 128, "vocab_size": 512}
_BERT_CUDA = {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6,
              "intermediate_size": 1536, "vocab_size": 8192}
_LLM_CPU = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512}
_LLM_CUDA = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
             "num_key_value_heads": 4, "intermediate_size": 1536, "vocab_size": 8192}
_VIT_CPU = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 128, "image_size": 32, "patch_size": 8}
_VIT_CUDA = {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6,
             "intermediate_size": 1536, "image_size": 224, "patch_size": 16}
_SEQ2SEQ_CPU = {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
                "encoder_attention_heads": 4, "decoder_attention_heads": 4,
                "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "vocab_size": 512}
_SEQ2SEQ_CUDA = {"d_model": 512, "encoder_layers": 4, "decoder_layers": 4,
                 "encoder_attention_heads": 8, "decoder_attention_heads": 8,
                 "encoder_ffn_dim": 2048, "decoder_ffn_dim": 2048, "vocab_size": 8192}

MODELS: dict[str, Spec] = {
    # vision
    "resnet": Spec("ResNetConfig", "ResNetModel", "image",
                   {**_SMALL_CNN, "embedding_size": 16, "hidden_sizes": [16, 32, 64, 64],
                    "depths": [1, 1, 1, 1]}, {"depths": [2, 2, 2, 2]}, trainable=True),
    "convnext": Spec("ConvNextConfig", "ConvNextModel", "image",
                     {"hidden_sizes": [16, 32, 64, 64], "depths": [1, 1, 1, 1]},
                     {"hidden_sizes": [96, 192, 384, 768], "depths": [2, 2, 6, 2]},
                     trainable=True),
    "mobilenet_v2": Spec("MobileNetV2Config", "MobileNetV2Model", "image",
                         {"depth_multiplier": 0.35, "image_size": 64}, {}, trainable=True),
    "efficientnet": Spec("EfficientNetConfig", "EfficientNetModel", "image",
                         {"width_coefficient": 0.25, "depth_coefficient": 0.25,
                          "image_size": 64, "hidden_dim": 320},
                         {"width_coefficient": 1.0, "depth_coefficient": 1.0, "image_size": 224,
                          "hidden_dim": 1280},
                         trainable=True),
    "regnet": Spec("RegNetConfig", "RegNetModel", "image",
                   {"embedding_size": 16, "hidden_sizes": [16, 32, 64, 64], "depths": [1, 1, 1, 1],
                    "groups_width": 8}, {}, trainable=True),
    "vit": Spec("ViTConfig", "ViTModel", "image", _VIT_CPU, _VIT_CUDA, trainable=True),
    "dinov2": Spec("Dinov2Config", "Dinov2Model", "image", _VIT_CPU, _VIT_CUDA,
                   trainable=True),
    "swin": Spec("SwinConfig", "SwinModel", "image",
                 {"image_size": 32, "patch_size": 2, "embed_dim": 16, "depths": [1, 1],
                  "num_heads": [2, 4], "window_size": 4},
                 {"image_size": 224, "patch_size": 4, "embed_dim": 96, "depths": [2, 2, 6, 2],
                  "num_heads": [3, 6, 12, 24], "window_size": 7}, trainable=True),
    # text encoders
    "bert": Spec("BertConfig", "BertModel", "tokens", _BERT_CPU, _BERT_CUDA),
    "distilbert": Spec("DistilBertConfig", "DistilBertModel", "tokens",
                       {"dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 128,
                        "vocab_size": 512},
                       {"dim": 384, "n_layers": 6, "n_heads": 6, "hidden_dim": 1536,
                        "vocab_size": 8192}),
    "roberta": Spec("RobertaConfig", "RobertaModel", "tokens", _BERT_CPU, _BERT_CUDA),
    # decoders
    "gpt2": Spec("GPT2Config", "GPT2LMHeadModel", "tokens",
                 {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 512},
                 {"n_embd": 512, "n_layer": 6, "n_head": 8, "vocab_size": 8192},
                 trainable=True),
    "llama": Spec("LlamaConfig", "LlamaForCausalLM", "tokens", _LLM_CPU, _LLM_CUDA,
                  trainable=True),
    "qwen2": Spec("Qwen2Config", "Qwen2ForCausalLM", "tokens", _LLM_CPU, _LLM_CUDA,
                  trainable=True),
    "mistral": Spec("MistralConfig", "MistralForCausalLM", "tokens", _LLM_CPU, _LLM_CUDA,
                    trainable=True),
    "gemma": Spec("GemmaConfig", "GemmaForCausalLM", "tokens", {**_LLM_CPU, "head_dim": 16},
                  {**_LLM_CUDA, "head_dim": 64}, trainable=True),
    "phi": Spec("PhiConfig", "PhiForCausalLM", "tokens", _LLM_CPU, _LLM_CUDA, trainable=True),
    "opt": Spec("OPTConfig", "OPTForCausalLM", "tokens",
                {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "ffn_dim": 128, "vocab_size": 512, "word_embed_proj_dim": 64},
                {"hidden_size": 512, "num_hidden_layers": 6, "num_attention_heads": 8,
                 "ffn_dim": 2048, "vocab_size": 8192, "word_embed_proj_dim": 512},
                trainable=True),
    # encoder-decoders
    "t5": Spec("T5Config", "T5Model", "seq2seq",
               {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4,
                "vocab_size": 512},
               {"d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 4, "num_heads": 8,
                "vocab_size": 8192}),
    "bart": Spec("BartConfig", "BartModel", "seq2seq", _SEQ2SEQ_CPU, _SEQ2SEQ_CUDA),
    "whisper": Spec("WhisperConfig", "WhisperModel", "mel",
                    {**_SEQ2SEQ_CPU, "num_mel_bins": 16, "max_source_positions": 32,
                     "max_target_positions": 64},
                    {**_SEQ2SEQ_CUDA, "num_mel_bins": 80, "max_source_positions": 750,
                     "max_target_positions": 448}),
    # speech and multimodal encoders
    "wav2vec2": Spec("Wav2Vec2Config", "Wav2Vec2Model", "audio",
                     {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "intermediate_size": 128, "conv_dim": [32, 32, 32],
                      "conv_stride": [5, 2, 2], "conv_kernel": [10, 3, 3],
                      "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4},
                     {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6,
                      "intermediate_size": 1536}),
    "clip_text": Spec("CLIPTextConfig", "CLIPTextModel", "tokens",
                      {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "intermediate_size": 128, "vocab_size": 512,
                       "max_position_embeddings": 64},
                      {"hidden_size": 512, "num_hidden_layers": 6, "num_attention_heads": 8,
                       "intermediate_size": 2048, "vocab_size": 8192,
                       "max_position_embeddings": 256}),
    "clip_vision": Spec("CLIPVisionConfig", "CLIPVisionModel", "image",
                        {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "intermediate_size": 128, "image_size": 32, "patch_size": 8},
                        {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6,
                         "intermediate_size": 1536, "image_size": 224, "patch_size": 16}),
}
TRAINABLE = tuple(name for name, spec in MODELS.items() if spec.trainable)

# Batch and size of what each kind of model is fed, per device.
_FEED = {"cpu": {"batch": 2, "image": 32, "seq": 32, "audio": 1600},
         "cuda": {"batch": 16, "image": 224, "seq": 256, "audio": 16000}}


_SPECIAL_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                   "decoder_start_token_id": 1, "start_token_id": 1}


class _Outputs(nn.Module):
    """A transformers model called with its inputs in a fixed order (positional, as benchmarks
    and stress runs call models), returning a tuple of its output tensors."""

    def __init__(self, model: nn.Module, names: tuple[str, ...]) -> None:
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.model(**dict(zip(self.names, args, strict=False)), **kwargs, return_dict=True)
        return tuple(v for v in out.values() if isinstance(v, torch.Tensor))


def _outputs(name: str, model: nn.Module, names: tuple[str, ...]) -> _Outputs:
    """``_Outputs`` with a forward of its own per corpus model: dynamo keeps compiled frames
    per code object and stops compiling one after eight, so models sharing one forward
    would run eagerly from the ninth model on in a process (a stress or bench run)."""
    code = _Outputs.forward.__code__.replace(co_name=f"forward_{name}")
    forward = types.FunctionType(code, _Outputs.forward.__globals__, f"forward_{name}")
    cls = type(f"{name}_outputs", (_Outputs,), {"forward": forward})
    return cls(model, names)  # type: ignore[no-any-return]


def _no_dropout(config: Any) -> None:
    """Every dropout, stochastic-depth, layer-drop and masking probability to 0."""
    for key, value in config.to_dict().items():
        if isinstance(value, float) and ("drop" in key or key.startswith("mask_")):
            setattr(config, key, 0.0)


def _build(spec: Spec, device: str) -> nn.Module:
    import transformers

    sizes = spec.cpu if device == "cpu" else {**spec.cpu, **spec.cuda}
    config_class = getattr(transformers, spec.config)
    # The pretrained special-token ids lie past a small vocabulary.
    defaults = config_class().to_dict()
    tokens = {k: v for k, v in _SPECIAL_TOKENS.items() if defaults.get(k) is not None}
    config = config_class(**sizes, **tokens)
    _no_dropout(config)
    model: nn.Module = getattr(transformers, spec.model)(config)
    return model


def _feed(spec: Spec, config: Any, device: str, dtype: torch.dtype,
          steps: int) -> list[dict[str, torch.Tensor]]:
    feed = _FEED["cpu" if device == "cpu" else "cuda"]
    batch, seq = feed["batch"], feed["seq"]
    vocab = int(getattr(config, "vocab_size", 512) or 512)
    out = []
    for _ in range(steps):
        if spec.inputs == "image":
            size = int(getattr(config, "image_size", feed["image"]) or feed["image"])
            out.append({"pixel_values": torch.randn(batch, 3, size, size, dtype=dtype)})
        elif spec.inputs == "tokens":
            out.append({"input_ids": torch.randint(0, vocab, (batch, seq))})
        elif spec.inputs == "seq2seq":
            out.append({"input_ids": torch.randint(0, vocab, (batch, seq)),
                        "decoder_input_ids": torch.randint(0, vocab, (batch, seq // 2))})
        elif spec.inputs == "mel":
            frames = 2 * int(config.max_source_positions)
            out.append({"input_features": torch.randn(batch, config.num_mel_bins, frames,
                                                      dtype=dtype),
                        "decoder_input_ids": torch.randint(0, vocab, (batch, seq // 2))})
        else:  # audio
            out.append({"input_values": torch.randn(batch, feed["audio"], dtype=dtype)})
    return [{k: v.to(device) for k, v in step.items()} for step in out]


def _forward_backward(model: nn.Module) -> Callable[[Any, tuple[torch.Tensor, ...]], Any]:
    """One training step's worth of autograd: outputs, then the gradient of every parameter."""
    params = [p for p in model.parameters() if p.requires_grad]

    def run(fn: Any, feed: tuple[torch.Tensor, ...]) -> Any:
        outputs = fn(*feed)
        loss = sum(o.float().pow(2).mean() for o in outputs if o.is_floating_point())
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        return (tuple(o.detach() for o in outputs),
                tuple(g for g in grads if g is not None))

    return run


def make(name: str, *, device: str = "cpu", dtype: torch.dtype | str = torch.float32,
         train: bool = False, steps: int = 4) -> Workload:
    """Build corpus model ``name`` (see ``MODELS``) for ``device`` and ``dtype``; ``train``
    serves forward and backward (vision and decoder models, ``TRAINABLE``)."""
    if name not in MODELS:
        raise ValueError(f"unknown corpus model {name!r}; the corpus has {sorted(MODELS)}")
    spec = MODELS[name]
    if train and not spec.trainable:
        raise ValueError(f"corpus model {name!r} has no train-mode variant; those that do: "
                         f"{list(TRAINABLE)}")
    if isinstance(dtype, str):
        dtype = _dtype(dtype)
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise ImportError("the corpus needs transformers: pip install -e '.[models]'") from e
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        inner = _build(spec, device)
        named = _feed(spec, inner.config, device, dtype, steps)
        model = _outputs(name, inner, tuple(named[0])).to(device, dtype)
        model.train(train)
        model.requires_grad_(train)  # inference: no autograd graph, whatever the grad mode
        twin = copy.deepcopy(model)
        feeds = [tuple(feed.values()) for feed in named]
    if train:
        run, twin_run = _forward_backward(model), _forward_backward(twin)
        # Gradients of deep CNNs reach tens (batch norm): their tolerance scales with the
        # largest one (plain torch.compile's ResNet gradients differ from eager by 0.3 %).
        _, grads = twin_run(twin, feeds[0])
        scale = max([1.0, *(float(g.abs().max()) for g in grads)])
        return Workload(f"{name}:train", model, lambda step: feeds[step % steps],
                        lambda step: twin_run(twin, feeds[step % steps]),
                        tolerance(dtype) * 10 * scale,
                        call=lambda fn, step: run(fn, feeds[step % steps]))
    return Workload(name, model, lambda step: feeds[step % steps],
                    lambda step: twin(*feeds[step % steps]), tolerance(dtype))


def _dtype(name: str) -> torch.dtype:
    resolved = getattr(torch, name, None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; use float32, bfloat16 or float16")
    return resolved
