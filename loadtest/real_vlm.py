"""A tiny random-weight vision-language model for real vLLM (CPU build), made locally: nothing downloaded.

``build_vlm_model_dir(d)`` writes an **Idefics3** (SmolVLM architecture) model directory: a Llama text model
(hidden 256, 2 layers), a SigLIP-style vision encoder (hidden 64, 2 layers, 64x64 images in 4x4 patches) and the
pixel-shuffle connector (scale 2), so one image is ``(64 / 4) ** 2 / 2 ** 2 = 64`` ``<image>`` tokens, framed by
``<fake_token_around_image><global-img>`` ... ``<fake_token_around_image>``: ``IMAGE_TOKENS = 67`` prompt tokens
(image splitting off). The tokenizer is a byte-level BPE trained here on ``loadtest.real_vllm.WORDS`` with the
Idefics3 specials; the chat template is Llama-3 style and renders an image part as ``<image>``. Weights come from
``--load-format dummy``. Architectures that need torchvision (LLaVA, Qwen2-VL, ...) do not start on the CPU build
here (PyPI's torchvision for this torch is a CUDA build); Idefics3's image processor has a PIL backend.

``vlm_spec(name, cpu)`` is the engine spec: the render endpoints on (``--enable-scale-out``).
"""

from __future__ import annotations

import base64
import json
import struct
import zlib
from pathlib import Path

from loadtest.real_vllm import BOS, EOS, SPECIALS, EngineSpec, train_tokenizer

#: the processor's image tokens (Idefics3Processor's names)
IMAGE, FAKE, GLOBAL, END_OF_UTTERANCE = (
    "<image>",
    "<fake_token_around_image>",
    "<global-img>",
    "<end_of_utterance>",
)
#: the 6 x 6 tile tokens the processor looks up (unused with image splitting off, but they must exist)
TILES = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
#: vision encoder input side (pixels), patch side (pixels) and the connector's pixel-shuffle scale
IMAGE_SIZE, PATCH, SCALE = 64, 4, 2
#: ``<image>`` tokens per image, and prompt tokens per image with its frame
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH) ** 2 // SCALE**2
IMAGE_TOKENS = IMAGE_SEQ_LEN + 3
VLM_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% else %}<image>{% endif %}{% endfor %}{% endif %}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def _train_tokenizer(d: Path, vocab_size: int) -> dict[str, int]:
    """Train and save ``tokenizer.json`` (Llama-3 style and Idefics3 specials, BOS added); returns special ids."""
    tok, ids = train_tokenizer([*SPECIALS, FAKE, IMAGE, END_OF_UTTERANCE, GLOBAL, *TILES], vocab_size)
    tok.save(str(d / "tokenizer.json"))
    ids["<vocab>"] = tok.get_vocab_size()
    return ids


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=1))


def _model_config(ids: dict[str, int]) -> dict[str, object]:
    """``config.json``: Idefics3 over a tiny Llama and a tiny vision encoder."""
    vocab = -(-ids["<vocab>"] // 64) * 64
    text = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": vocab,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[EOS],
        "pad_token_id": ids[EOS],
    }
    vision = {
        "model_type": "idefics3_vision",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_channels": 3,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6,
    }
    return {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": "idefics3",
        "image_token_id": ids[IMAGE],
        "scale_factor": SCALE,
        "tie_word_embeddings": False,
        "pad_token_id": ids[EOS],
        "torch_dtype": "bfloat16",
        "text_config": text,
        "vision_config": vision,
    }


def build_vlm_model_dir(d: Path, vocab_size: int = 2048) -> Path:
    """Write the tiny Idefics3 model directory into ``d`` (see the module docstring); returns ``d``."""
    d.mkdir(parents=True, exist_ok=True)
    ids = _train_tokenizer(d, vocab_size)
    _write_json(
        d / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": EOS,
            "add_bos_token": True,
            "model_max_length": 8192,
            "additional_special_tokens": [FAKE, IMAGE, END_OF_UTTERANCE],
            "chat_template": VLM_CHAT_TEMPLATE,
            "processor_class": "Idefics3Processor",
        },
    )
    _write_json(d / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS})
    _write_json(d / "config.json", _model_config(ids))
    _write_json(d / "generation_config.json", {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS]})
    _write_json(
        d / "preprocessor_config.json",
        {
            "image_processor_type": "Idefics3ImageProcessor",
            "processor_class": "Idefics3Processor",
            "do_convert_rgb": True,
            "do_resize": True,
            "size": {"longest_edge": IMAGE_SIZE},
            "max_image_size": {"longest_edge": IMAGE_SIZE},
            "do_image_splitting": False,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "do_pad": True,
            "resample": 1,
        },
    )
    _write_json(
        d / "processor_config.json",
        {
            "processor_class": "Idefics3Processor",
            "image_seq_len": IMAGE_SEQ_LEN,
            "chat_template": VLM_CHAT_TEMPLATE,
        },
    )
    return d


def vlm_spec(name: str, cpu: int | None, gpu_blocks: int = 200) -> EngineSpec:
    """One engine serving the tiny VLM with the render endpoints on (``--enable-scale-out``)."""
    return EngineSpec(
        name, cpu=cpu, gpu_blocks=gpu_blocks, max_model_len=4096, extra_args=["--enable-scale-out"]
    )


def png_data_url(rgb: tuple[int, int, int], side: int = 32) -> str:
    """A ``data:image/png;base64,...`` URL of a ``side`` x ``side`` image of one colour (a PNG written here)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\x00" + bytes(rgb) * side
    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(row * side))
        + chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")
