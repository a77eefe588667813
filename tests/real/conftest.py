"""Session fixtures for the real-engine tests: vLLM's CPU build installed (cached), a tiny random-weight model,
two real engines (one core each) shared by every test, and a factory starting ``kvroute serve`` in front of them.

Engines take ~25-40 s to start in eager mode (``tests.real.support.eager``; ~55-120 s compiled) and 3.4 GB each,
so they are started once per session; tests that restart an engine replace its handle in ``RealFleet.engines``
(look engines up through the fleet, not by holding a handle). Every process is stopped at the end of the session,
also when a test fails.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from loadtest.real_vllm import RESPONSES_STORE_ENV, EngineSpec, RealFleet, build_model_dir, ensure_vllm
from tests.otlp_receiver import Receiver, grpc_receiver
from tests.real.support import Router, eager, start_router, traced

#: first-test budget: install (when cold, minutes) + two engines starting together (~2 min, more under load)
SESSION_TIMEOUT_S = 1800


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give every real-engine test a budget that covers the session fixtures it may have to set up."""
    for item in items:
        if "tests/real/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.timeout(SESSION_TIMEOUT_S))


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The engine venv's python (installed into .cache/vllm-venv when missing)."""
    return ensure_vllm()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model directory (config + trained tokenizer + chat template)."""
    return build_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def otlp() -> Iterator[Receiver]:
    """An OTLP/gRPC receiver (tests/otlp_receiver.py) the engines started with tracing export their spans to."""
    yield from grpc_receiver()


@pytest.fixture(scope="session")
def real_fleet(
    vllm_python: Path, model_dir: Path, tmp_path_factory: pytest.TempPathFactory, otlp: Receiver
) -> Iterator[RealFleet]:
    """Two real engines: r0 (400 blocks of 32 tokens) on CPU 0, r1 (128 blocks, for eviction) on CPU 1; both keep
    Responses API responses (``VLLM_ENABLE_RESPONSES_API_STORE=1``); r0 exports its request spans to ``otlp``."""
    cpus = sorted(os.sched_getaffinity(0))
    specs = [
        traced(EngineSpec("r0", cpu=cpus[0], gpu_blocks=400, env=dict(RESPONSES_STORE_ENV)), otlp.endpoint),
        EngineSpec("r1", cpu=cpus[-1], gpu_blocks=128, max_model_len=2048, env=dict(RESPONSES_STORE_ENV)),
    ]
    fleet = RealFleet(vllm_python, model_dir, eager(specs), tmp_path_factory.mktemp("engine-logs"))
    with fleet:
        fleet.start()
        yield fleet


@pytest.fixture
def router(real_fleet: RealFleet, model_dir: Path) -> Iterator[Callable[..., Router]]:
    """Factory: ``router(names=("r0",), *extra_flags)`` starts ``kvroute serve`` in front of those engines
    (hf tokenizer on the model dir, block size 32) and waits until it is ready; all stopped after the test."""
    started: list[Router] = []

    def make(names: tuple[str, ...] = ("r0", "r1"), *extra: str, wait_feeds: bool = True) -> Router:
        engines = [e for e in real_fleet.engines if e.name in names]
        r = start_router(engines, model_dir, *extra, wait_feeds=wait_feeds)
        started.append(r)
        return r

    yield make
    for r in started:
        r.stop()
