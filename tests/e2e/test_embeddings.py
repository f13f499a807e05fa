"""/v1/embeddings with all-MiniLM-L6-v2 served beside Qwen2.5-Coder-0.5B (`kvseal serve --embed-model`), unified and
disaggregated, through the official openai client and plain HTTP: equal to sentence-transformers (cosine >= 0.99999
in float32) as floats and as base64, through LiteLLM and LangChain too; text and token ids give the same vectors;
usage counts the tokens; what the model cannot do (fewer dimensions, an input over its length) is a 400 naming it;
keys, rpm and the admin-only metrics hold as on every endpoint; and one tenant's flood does not hold up another
tenant's request (the embed worker's fair queue)."""

from __future__ import annotations

import base64
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from sentence_transformers import SentenceTransformer

from kvseal.embed.folder import load_tokenizer
from tests.helpers.procs import Server
from tests.helpers.qwen_server import KEYS
from tests.helpers.real_models import real_model

pytestmark = pytest.mark.e2e
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no price list from GitHub
MODEL = "all-MiniLM-L6-v2"
TEXTS = ["The cat sits on the mat.", "", "Ünïcödé, 中文 and emoji 🚀 in one sentence!",
         "A kvseal router sends each embedding request to its embed worker. " * 14,  # ~200 tokens
         "short"]


@dataclass
class Setup:
    url: str
    reference: SentenceTransformer
    tokenizer: Any

    def client(self, tenant: str = "e-alice") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=600)

    def post(self, body: dict[str, Any], tenant: str = "e-alice") -> httpx.Response:
        return httpx.post(self.url + "/v1/embeddings", json={"model": MODEL, **body}, timeout=600,
                          headers={"Authorization": f"Bearer {KEYS[tenant]}"})


@pytest.fixture(scope="module")
def reference() -> SentenceTransformer:
    return SentenceTransformer(real_model("all-minilm-l6-v2"), device="cpu")


@pytest.fixture(scope="module")
def setup(qwen_server: Server, reference: SentenceTransformer) -> Setup:
    return Setup(qwen_server.url, reference, load_tokenizer(Path(real_model("all-minilm-l6-v2"))))


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.asarray((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1))


def test_embeddings_equal_sentence_transformers_as_floats_and_as_base64(setup: Setup) -> None:
    want = setup.reference.encode(TEXTS, convert_to_numpy=True)
    r = setup.client().embeddings.create(model=MODEL, input=TEXTS)  # the openai client asks for base64
    got = np.array([d.embedding for d in r.data], dtype=np.float32)
    assert [d.index for d in r.data] == list(range(len(TEXTS))) and r.model == MODEL
    assert cosines(got, want).min() >= 0.99999
    tokens = sum(len(e.ids) for e in setup.tokenizer.encode_batch(TEXTS))
    assert r.usage.prompt_tokens == r.usage.total_tokens == tokens
    floats = setup.post({"input": TEXTS, "encoding_format": "float"}).json()["data"]
    b64 = setup.post({"input": TEXTS, "encoding_format": "base64"}).json()["data"]
    # the same batch gives the same float32 bits, whatever their encoding
    assert (np.array([d["embedding"] for d in floats], dtype=np.float32) == got).all()
    assert (np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in b64]) == got).all()
    assert np.linalg.norm(got, axis=1) == pytest.approx(1.0, abs=1e-5)  # the checkpoint's Normalize module


def test_text_and_token_ids_give_the_same_vectors(setup: Setup) -> None:
    ids = [list(e.ids) for e in setup.tokenizer.encode_batch(TEXTS[:2])]  # [CLS] ... [SEP]: the caller's to send
    one = setup.post({"input": TEXTS[0]}).json()["data"][0]["embedding"]
    by_ids = setup.post({"input": ids[0]}).json()
    lists = setup.post({"input": ids}).json()
    texts = setup.post({"input": TEXTS[:2]}).json()
    assert by_ids["data"][0]["embedding"] == one and lists["data"] == texts["data"]  # same batches: same bits
    assert lists["data"][0]["embedding"] == pytest.approx(one, abs=1e-6)  # another batch: float32 rounding apart
    assert by_ids["usage"]["prompt_tokens"] == len(ids[0])


def test_litellm_and_langchain_embed_through_kvseal(setup: Setup) -> None:
    import litellm  # here: after LITELLM_LOCAL_MODEL_COST_MAP above
    from langchain_openai import OpenAIEmbeddings

    want = setup.reference.encode(TEXTS[:2], convert_to_numpy=True)
    lite = litellm.embedding(model="openai/" + MODEL, api_base=setup.url + "/v1", api_key=KEYS["e-alice"],
                             input=TEXTS[:2])
    lc = OpenAIEmbeddings(base_url=setup.url + "/v1", api_key=KEYS["e-alice"], model=MODEL,
                          check_embedding_ctx_length=False)  # else it sends tiktoken's ids (docs/clients.md)
    for got in ([d["embedding"] for d in lite.data], lc.embed_documents(TEXTS[:2])):
        assert cosines(np.array(got, dtype=np.float32), want).min() >= 0.99999


def test_what_the_model_cannot_do_is_a_400_naming_it(setup: Setup) -> None:
    def refused(body: dict[str, Any], status: int = 400) -> dict[str, Any]:
        r = setup.post(body)
        assert r.status_code == status, (body, r.text)
        error: dict[str, Any] = r.json()["error"]
        return error

    assert setup.post({"input": "hi", "dimensions": 384}).status_code == 200  # its own width: nothing to change
    assert refused({"input": "hi", "dimensions": 128})["param"] == "dimensions"
    long = refused({"input": ["fine", "word " * 300]})
    assert long["param"] == "input" and long["code"] == "context_length_exceeded"
    assert "input 1 is 302 tokens" in long["message"]
    assert refused({"input": [[101, 30522, 102]]})["param"] == "input"  # outside the vocabulary
    assert refused({"input": []})["param"] == "input"
    assert refused({"input": "hi", "encoding_format": "int8"})["param"] == "encoding_format"
    assert refused({"input": "hi", "truncate": True})["param"] == "truncate"
    assert refused({"input": "hi", "model": "qwen2.5-coder-0.5b-instruct"}, 404)["param"] == "model"
    models = [m.id for m in setup.client().models.list()]
    assert models == ["qwen2.5-coder-0.5b-instruct", MODEL]


def test_keys_rpm_and_metrics_hold_as_on_every_endpoint(setup: Setup) -> None:
    assert httpx.post(setup.url + "/v1/embeddings", json={"model": MODEL, "input": "hi"}).status_code == 401
    statuses = [setup.post({"input": "hi"}, "e-limited").status_code for _ in range(3)]
    assert statuses == [200, 200, 429]  # rpm=2
    before = embedded_tokens(setup, "e-bob")
    n = setup.post({"input": ["one two three", "four"]}, "e-bob").json()["usage"]["prompt_tokens"]
    assert embedded_tokens(setup, "e-bob") == before + n
    tenant = httpx.get(setup.url + "/metrics", headers={"Authorization": f"Bearer {KEYS['e-alice']}"})
    assert tenant.status_code == 403


def embedded_tokens(setup: Setup, tenant: str) -> float:
    text = httpx.get(setup.url + "/metrics", headers={"Authorization": f"Bearer {KEYS['e-admin']}"}).text
    line = f'kvseal:tenant_embedding_tokens_total{{tenant="{tenant}"}} '
    return next((float(x[len(line):]) for x in text.splitlines() if x.startswith(line)), 0.0)


def test_a_tenants_flood_does_not_hold_up_another_tenants_request(setup: Setup) -> None:
    """Alice queues 4 calls of 64 inputs (over ten of the worker's batches); Bob's one input, sent once they wait,
    is answered before Alice's last two: first come, first served would answer it after all of hers."""
    done: dict[str, float] = {}
    flood = ["alice floods the embed worker with many medium sized sentences of text " * 3] * 64

    def send(name: str, tenant: str, inputs: list[str]) -> None:
        r = setup.post({"input": inputs}, tenant)
        assert r.status_code == 200, r.text
        done[name] = time.monotonic()

    alice = [threading.Thread(target=send, args=(f"a{k}", "e-alice", flood)) for k in range(4)]
    for t in alice:
        t.start()
    deadline = time.monotonic() + 60
    while queued_inputs(setup) < 128 and time.monotonic() < deadline:  # her calls wait in the worker's queue
        time.sleep(0.2)
    send("bob", "e-bob", ["bob's one sentence"])
    for t in alice:
        t.join()
    assert len(done) == 5
    last_two = sorted(done[f"a{k}"] for k in range(4))[2:]
    assert done["bob"] < last_two[0], done


def queued_inputs(setup: Setup) -> float:
    text = httpx.get(setup.url + "/metrics", headers={"Authorization": f"Bearer {KEYS['e-admin']}"}).text
    line = "kvseal:embedding_queued_inputs "
    return next((float(x[len(line):]) for x in text.splitlines() if x.startswith(line)), 0.0)
