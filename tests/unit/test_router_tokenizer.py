"""Tokenizer modes: hf (a tiny BPE built here + a chat template), bytes, and the HF-style template rendering."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.tokens.tokenizer import (
    BytesTokenizer,
    HfTokenizer,
    TokenizerError,
    bytes_token_ids,
    compile_chat_template,
    make_tokenizer,
)

# A ChatML-like template written the way HF templates are: block tags on their own lines, relying on
# trim_blocks / lstrip_blocks to remove the layout whitespace.
TEMPLATE = """{{ bos_token }}{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unsupported role ' + message['role']) }}
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def _by_hand(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """What TEMPLATE renders to, written out by hand."""
    out = "<s>"
    for m in messages:
        out += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
    if add_generation_prompt:
        out += "<|im_start|>assistant\n"
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    d = tmp_path_factory.mktemp("tiny-bpe")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = [
        "the quick brown fox jumps over the lazy dog",
        "you are a helpful assistant",
        "what is the capital of france? paris is the capital of france.",
        "hello world, routing requests to the replica that holds the cache",
    ] * 20
    tok.train_from_iterator(corpus, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)]
    )
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": {
                    "content": "</s>",
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                },
                "unk_token": "<unk>",
                "chat_template": TEMPLATE,
            }
        )
    )
    return d


MESSAGES = [
    {"role": "system", "content": "you are a helpful assistant"},
    {"role": "user", "content": "what is the capital of france?"},
]


async def test_hf_chat_ids_equal_template_applied_by_hand(model_dir: Path) -> None:
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok = make_tokenizer("hf", str(model_dir))
    assert tok.mode == "hf"
    for agp in (True, False):
        ids = await tok.encode_chat(MESSAGES, model="m", add_generation_prompt=agp)
        expected = raw.encode(_by_hand(MESSAGES, agp), add_special_tokens=False).ids
        assert ids == expected
    # special tokens are single ids (not spelled out), and BOS is not added twice
    ids = await tok.encode_chat(MESSAGES, model="m")
    bos, im_start = raw.token_to_id("<s>"), raw.token_to_id("<|im_start|>")
    assert bos is not None and im_start is not None
    assert ids[0] == bos and ids[1] == im_start
    assert ids.count(bos) == 1
    assert ids.count(im_start) == 3


async def test_hf_rendering_matches_by_hand_text(model_dir: Path) -> None:
    tok = HfTokenizer(model_dir)
    assert tok.render_chat(MESSAGES) == _by_hand(MESSAGES)
    # content given as text parts is flattened like vLLM does
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}
    ]
    assert tok.render_chat(parts) == _by_hand([{"role": "user", "content": "hello\nworld"}])


async def test_hf_completion_prompt_adds_bos_once(model_dir: Path) -> None:
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok = make_tokenizer("auto", str(model_dir))
    ids = await tok.encode_prompt("hello world", model="m")
    assert ids == raw.encode("hello world").ids
    assert ids[0] == raw.token_to_id("<s>")


async def test_shared_conversation_prefix_shares_token_prefix(model_dir: Path) -> None:
    tok = HfTokenizer(model_dir)
    turn1 = await tok.encode_chat(MESSAGES, model="m", add_generation_prompt=False)
    turn2 = await tok.encode_chat(
        MESSAGES + [{"role": "assistant", "content": "paris"}, {"role": "user", "content": "and the fox?"}],
        model="m",
    )
    assert turn2[: len(turn1)] == turn1


async def test_template_errors_are_tokenizer_errors(model_dir: Path) -> None:
    tok = HfTokenizer(model_dir)
    with pytest.raises(TokenizerError, match="unsupported role tool"):
        await tok.encode_chat([{"role": "tool", "content": "x"}], model="m")
    with pytest.raises(TokenizerError, match="role"):
        await tok.encode_chat([{"content": "no role"}], model="m")
    with pytest.raises(TokenizerError, match="only text parts"):
        await tok.encode_chat(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], model="m"
        )


def test_missing_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        make_tokenizer("hf", str(tmp_path))
    with pytest.raises(TokenizerError, match="needs tokenizer_path"):
        make_tokenizer("hf", None)


def test_hf_environment_features() -> None:
    t = compile_chat_template(
        "{% for x in xs %}{% if x == 2 %}{% continue %}{% endif %}{{ x }}{% endfor %}"
        "|{{ {'a': 'é'} | tojson }}|{% generation %}gen{% endgeneration %}"
    )
    assert t.render(xs=[1, 2, 3]) == '13|{"a": "é"}|gen'


async def test_bytes_mode_is_deterministic_and_prefix_sharing() -> None:
    tok = make_tokenizer("auto", None)
    assert isinstance(tok, BytesTokenizer)
    a = await tok.encode_prompt("A" * 64 + " first question", model="m")
    b = await tok.encode_prompt("A" * 64 + " second question", model="m")
    assert a == bytes_token_ids("A" * 64 + " first question")
    assert a[:16] == b[:16] and a != b
    assert all(0 < t < 2**32 for t in a)
    assert len(a) == -(-len("A" * 64 + " first question") // 4)
    chat1 = await tok.encode_chat(MESSAGES, model="m", add_generation_prompt=False)
    chat2 = await tok.encode_chat(MESSAGES + [{"role": "user", "content": "more"}], model="m")
    n = len(chat1) - 1  # the last chunk may straddle the boundary
    assert chat2[:n] == chat1[:n]


_POOL_PROBE = """
import os, sys
from router.tokens.tokenizer import make_tokenizer
before = len(os.listdir("/proc/self/task"))
tok = make_tokenizer("hf", sys.argv[1], parallel=sys.argv[2] == "1")  # its start-up checks tokenize too
ids = [tok.encode_text("the quick brown fox " * 200, add_special_tokens=False) for _ in range(3)]
assert all(ids) and ids[0] == ids[1]
print(len(os.listdir("/proc/self/task")) - before)
"""


@pytest.mark.parametrize("parallel", [False, True])
def test_tokenizer_parallel_decides_whether_the_library_starts_its_thread_pool(
    model_dir: Path, parallel: bool
) -> None:
    """``tokenizer_parallel`` off: the tokenizers library runs every call on the calling thread and never starts
    its Rust pool (no new OS thread, whatever TOKENIZERS_PARALLELISM the process was started with); on (the
    default): its first call starts the pool. Each case in a fresh process (the pool, once started, stays)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false" if parallel else "true"}  # the setting wins
    out = subprocess.run(
        [sys.executable, "-c", _POOL_PROBE, str(model_dir), "1" if parallel else "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr
    new_threads = int(out.stdout.strip())
    assert (new_threads > 0) == parallel, new_threads
