"""`--chat-template FILE`: chats are rendered with the operator's template (on the router of a fleet, whose
workers still pass the fleet check), /tokenize shows it, and a template that does not parse stops the start."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers.procs import Server

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
TEMPLATE = ("{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>> {% endif %}")


@pytest.fixture(scope="module", params=["unified", "disaggregated"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    path.write_text(TEMPLATE)
    mode = ["--unified"] if request.param == "unified" else []
    s = Server([*mode, "--max-model-len", "1024", "--chat-template", str(path)])
    try:
        yield s.ready()
    finally:
        s.stop()


def test_chats_are_rendered_with_the_given_template(server: Server) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    r = httpx.post(server.url + "/tokenize", json={"messages": msgs}, timeout=30).json()
    text = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}, timeout=30).json()["prompt"]
    assert text == "<<system>> Be brief.\n<<user>> Name a color.\n<<assistant>> "
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    out = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0)
    assert out.usage.prompt_tokens == r["count"]


def test_a_template_that_does_not_parse_stops_the_start(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    for mode in (["--unified"], []):
        p = subprocess.run([sys.executable, "-m", "kvseal", "serve", *mode, "--chat-template", str(bad)],
                           capture_output=True, text=True, timeout=120, check=False)
        assert p.returncode == 2 and "--chat-template" in p.stderr and "jinja2" in p.stderr, p.stderr
