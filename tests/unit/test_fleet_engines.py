"""The fake and real engine handles of the load tests share one description of an engine's endpoints."""

from __future__ import annotations

from pathlib import Path
from typing import cast

from fakes.fleet import HOST, EngineEndpoints, EngineHandle, ManagedProcess
from loadtest.real_vllm import EngineSpec, RealEngine, engine_args

NO_PROC = cast(ManagedProcess, None)  # the endpoints are computed from the ports alone


def test_fake_and_real_engines_name_their_endpoints_alike() -> None:
    fake = EngineHandle(port=8001, events_port=5557, replay_port=5558, proc=NO_PROC, name="engine0")
    real = RealEngine(port=8001, events_port=5557, replay_port=5558, proc=NO_PROC, spec=EngineSpec("r0"))
    for e in (fake, real):
        assert isinstance(e, EngineEndpoints)
        assert (e.url, e.events_url, e.replay_url) == (
            f"http://{HOST}:8001",
            f"tcp://{HOST}:5557",
            f"tcp://{HOST}:5558",
        )
    assert real.name == "r0" and real.replica_spec().startswith(f"name=r0,url=http://{HOST}:8001,")
    assert f"events=tcp://{HOST}:5557,replay=tcp://{HOST}:5558" in real.replica_spec()


def test_an_eager_engine_skips_the_compile_and_keeps_every_other_flag() -> None:
    def args(eager: bool) -> list[str]:
        spec = EngineSpec("r0", extra_args=["--x"], eager=eager)
        return engine_args(Path("/venv/bin/python"), Path("/m"), spec, 1, 2, 3)

    compiled, eager = args(False), args(True)
    # vLLM's default (torch.compile), as the benchmarks and deployments run
    assert "--enforce-eager" not in compiled
    assert [a for a in eager if a != "--enforce-eager"] == compiled
    assert eager.count("--enforce-eager") == 1 and eager[-1] == "--x"  # the spec's own flags still come last
