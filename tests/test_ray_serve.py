"""kvg-serve as a Ray Serve application on a local Ray instance: two replicas behind one HTTP API."""

import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import ray
from ray import serve

from runtime.artifact import ArtifactError, SessionOptions
from runtime.generator import GenerationConfig, Generator
from runtime.ray_app import DEPLOYMENT, app_builder

MODEL = "fox-tiny"


@pytest.fixture(scope="module")
def ray_url(exported, tmp_path_factory):
    folder = exported("fox-tiny", "static")[0].path
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(tmp_path_factory.mktemp("ray")))
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = {"artifact": str(folder), "model_name": MODEL, "max_batch": "4", "provider": "cpu", "replicas": "2",
                "replica_cpus": "0.5", "threads": "1"}  # fmt: skip
        serve.run(app_builder(args), name=DEPLOYMENT, route_prefix="/")
        yield f"http://127.0.0.1:{port}", folder
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_answer_many_clients_with_the_tokens_each_gets_alone(ray_url):
    url, folder = ray_url
    replicas = serve.status().applications[DEPLOYMENT].deployments[DEPLOYMENT].replica_states
    assert replicas == {"RUNNING": 2}
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = [[5 + i, 6 + i, 7 + 2 * i] for i in range(12)]

    def ask(index: int):
        if index % 2:  # half stream, as the API's other clients do
            chunks = list(api.completions.create(model=MODEL, prompt=prompts[index], max_tokens=12, temperature=0,
                                                 stream=True))  # fmt: skip
            return chunks[-1].choices[0].model_extra["token_ids"]
        answer = api.completions.create(model=MODEL, prompt=prompts[index], max_tokens=12, temperature=0)
        return answer.choices[0].model_extra["token_ids"]

    with ThreadPoolExecutor(12) as pool:
        got = list(pool.map(ask, range(12)))
    generator = Generator.open(folder, SessionOptions(provider="cpu"))
    assert got == [generator.generate([prompt], GenerationConfig(12)).tokens[0] for prompt in prompts]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert [model.id for model in api.models.list().data] == [MODEL]
    bad = httpx.post(f"{url}/v1/completions", json={"prompt": [], "max_tokens": 3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"


def test_the_app_builder_refuses_what_it_cannot_serve(exported):
    folder = exported("fox-tiny", "static")[0].path
    with pytest.raises(ValueError, match="unknown arguments \\['max_batches'\\]"):
        app_builder({"artifact": str(folder), "max_batches": "4"})
    with pytest.raises(ArtifactError, match="re-export with --cache static"):
        app_builder({"artifact": str(exported("fox-tiny", "dynamic")[0].path)})
