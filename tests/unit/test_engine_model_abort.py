"""EngineModel.abort: a request dropped wherever it is (its client went away) frees what it held, like vLLM."""

from __future__ import annotations

from fakes.engine_model import EngineModel, EngineRequest, Finished, FirstToken

BS = 16


def req(rid: str, first: int, n_prompt: int, n_out: int) -> EngineRequest:
    return EngineRequest(rid, n_prompt, n_out, token_ids=list(range(first, first + n_prompt)))


def run_until_idle(e: EngineModel, t: float = 0.0) -> list[object]:
    events: list[object] = []
    while (nxt := e.next_event_time()) is not None:
        t = nxt
        events += e.advance(t)
    return events


def test_abort_while_decoding_frees_its_blocks_and_keeps_the_prefix_cached() -> None:
    e = EngineModel("a100", num_gpu_blocks=64, block_size=BS)
    r = req("a", 1, 160, 500)
    e.submit(r, 0.0)
    t = 0.0
    first = False
    while not first:
        t = e.next_event_time() or t
        first = any(isinstance(ev, FirstToken) for ev in e.advance(t))
    t = e.next_event_time() or t
    e.advance(t)  # one decode step
    assert e.metrics().num_requests_running == 1 and e.metrics().kv_usage > 0
    events = e.abort(r, t)
    assert not any(isinstance(ev, Finished) for ev in events)
    m = e.metrics()
    assert m.num_requests_running == 0 and m.kv_usage == 0.0 and e.idle
    assert e._dec_ctx == 0  # no context of the dropped request left behind
    assert e.lookup(r.block_hashes or []) == (10, 0)  # its computed prompt blocks stay cached (evictable)


def test_abort_of_a_waiting_request_lets_the_queue_move_and_is_idempotent() -> None:
    e = EngineModel("a100", num_gpu_blocks=40, block_size=BS, max_running=1)
    a, b, c = req("a", 1, 300, 50), req("b", 1000, 300, 50), req("c", 2000, 300, 50)
    for r in (a, b, c):
        e.submit(r, 0.0)
    assert e.metrics().num_requests_waiting == 2  # a admitted at once, b and c queued
    e.abort(b, 0.0)
    e.abort(b, 0.0)  # already gone: nothing happens
    done = [ev.request.request_id for ev in run_until_idle(e) if isinstance(ev, Finished)]
    assert done == ["a", "c"]
    assert e.metrics().queued_prefill_tokens == 0 and e.metrics().requests_finished == 2


def test_abort_mid_prefill_drops_the_chunk_in_flight() -> None:
    e = EngineModel("a100", num_gpu_blocks=1024, block_size=BS, max_batch_tokens=512)
    r = req("long", 1, 4000, 10)
    e.submit(r, 0.0)
    t = e.next_event_time() or 0.0
    e.advance(t)  # first 512-token chunk done, the next one in flight
    e.next_event_time()
    e.abort(r, t)
    assert not any(isinstance(ev, FirstToken | Finished) for ev in run_until_idle(e, t))
    m = e.metrics()
    assert m.num_requests_running == 0 and m.kv_usage == 0.0 and m.queued_prefill_tokens == 0
