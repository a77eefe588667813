"""The official ``openai`` Python client (the ``test`` extra) drives the stand-in engine directly: chat, completions,
streaming with usage, a Responses chain (streamed, stored, background + cancel), embeddings from a pooling engine
(the client asks for base64 by default and decodes it), and errors mapped to the client's exception classes with
vLLM's ``type`` / ``param``. A client that parses the stand-in like this parses vLLM (the shapes are checked against
vLLM itself in ``tests/real/test_whole_api_parity.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.helpers import Proc, start_fake_engine

MODEL = "fake-m"


def _client(*extra: str, time_scale: str = "0") -> tuple[Proc, openai.OpenAI]:
    proc, port, _, _ = start_fake_engine(
        "--model", MODEL, "--time-scale", time_scale, "--block-size", "16", *extra
    )
    return proc, openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-test", max_retries=0, timeout=30
    )


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    # a little real time per model second, so that a long background job is still running when cancelled
    proc, c = _client("--enable-responses-store", "--api-key", "sk-test", time_scale="0.05")
    yield c
    c.close()
    proc.stop()


@pytest.fixture(scope="module")
def pooling_client() -> Iterator[openai.OpenAI]:
    proc, c = _client("--runner", "pooling", "--hidden-size", "32")
    yield c
    c.close()
    proc.stop()


def test_chat_completions_and_streaming_usage(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=3
    )
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens == 3
    done = client.completions.create(model=MODEL, prompt="hello world", max_tokens=2)
    assert done.choices[0].text and done.usage is not None and done.usage.prompt_tokens == len("hello world")
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content + " warm"  # the stand-in's words, one more token
    assert (
        chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    )


def test_responses_chain_stream_and_background(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL, input="hello world", instructions="be brief", max_output_tokens=3
    )
    assert first.id.startswith("resp_") and first.status == "incomplete" and first.output_text
    assert first.usage is not None and first.usage.input_tokens > 0
    second = client.responses.create(
        model=MODEL, input="and more", previous_response_id=first.id, max_output_tokens=3
    )
    assert second.previous_response_id == first.id
    assert second.usage is not None and second.usage.input_tokens_details.cached_tokens > 0
    assert client.responses.retrieve(second.id).output_text == second.output_text
    events = list(client.responses.create(model=MODEL, input="stream", max_output_tokens=2, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == events[-1].response.output_text
    job = client.responses.create(model=MODEL, input="job", background=True, max_output_tokens=4000)
    assert job.status == "queued"
    assert client.responses.cancel(job.id).status == "cancelled"
    assert client.responses.retrieve(job.id).status == "cancelled"


def test_embeddings(pooling_client: openai.OpenAI) -> None:
    out = pooling_client.embeddings.create(
        model=MODEL, input=["hello world", "hello there"]
    )  # base64 on the wire
    assert [len(d.embedding) for d in out.data] == [32, 32] and out.usage.prompt_tokens == len(
        "hello world"
    ) * 2
    assert abs(sum(x * x for x in out.data[0].embedding) - 1.0) < 1e-5
    floats = pooling_client.embeddings.create(model=MODEL, input="hello world", encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(out.data[0].embedding, abs=1e-6)


def test_errors_map_to_the_clients_exception_classes(
    client: openai.OpenAI, pooling_client: openai.OpenAI
) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert nf.value.status_code == 404 and nf.value.type == "NotFoundError" and nf.value.param == "model"
    with pytest.raises(openai.NotFoundError) as chain:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_unknown")
    assert chain.value.type == "invalid_request_error" and chain.value.param == "response_id"
    assert "Response with id 'resp_unknown' not found." in chain.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert bad.value.param == "max_tokens" and "max_tokens must be at least 1" in bad.value.message
    with pytest.raises(openai.BadRequestError) as dims:
        pooling_client.embeddings.create(model=MODEL, input="x", dimensions=8)
    assert "Matryoshka" in dims.value.message
    with pytest.raises(openai.NotFoundError):  # a pooling runner serves no chat
        pooling_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.AuthenticationError):
        client.with_options(api_key="wrong").models.list()
