"""Scale-out with Ray Serve (mcserve/server/ray/): two engine replicas of a tiny model on a
local Ray cluster (loopback), one Serve application for the whole module.

Affinity (the turns of a conversation land on one replica), fallback to the least loaded
replica under imbalance with state migration (token-identical to a recompute), the merged
/metrics, a killed replica (its requests 503, the other's unaffected, Serve restarts it), a
model that cannot load (the deployment fails with the loader's error), no leaked blocks, and
the drain that SIGTERM runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'mcserve[serve-ray]')")
serve = pytest.importorskip("ray.serve",
                            reason="Ray Serve is not installed (pip install 'ray[serve]')")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (the test extra)")

import torch  # noqa: E402

from mcserve.config import EngineConfig, ModelConfig  # noqa: E402
from mcserve.engine.llm import LLM  # noqa: E402
from mcserve.engine.llm_engine import LLMEngine  # noqa: E402
from mcserve.engine.sampling import SamplingParams  # noqa: E402
from mcserve.kernels import cpu as cpu_ops  # noqa: E402
from mcserve.models.native import MCForCausalLM  # noqa: E402
from mcserve.server.ray import (  # noqa: E402
    ENGINE_DEPLOYMENT,
    REPLICA_HEADER,
    DeploymentFailed,
    RayServeOptions,
    app_builder,
    build_serve_app,
    deploy,
    known_replicas,
    merge_metrics,
    options_from_args,
)
from mcserve.server.ray.replica import _export_when_computed  # noqa: E402

APP = "mcserve-test"
SEG = 16
# the engine as every replica builds it (float64: greedy ties cannot flip between replicas)
ENGINE = {"max_model_len": 1024, "num_state_blocks": 128, "dtype": "float64",
          "cpu_packed_weights": False, "max_num_seqs": 8, "max_num_batched_tokens": 256}
SYSTEM = "You are a careful assistant who answers in short sentences. " * 6  # ~360 bytes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=2, head_dim=16,
                      segment_len=SEG, mc_top_k=1, inner_chunk=4, memory_expansion=2)
    path = tmp_path_factory.mktemp("ray") / "tiny"
    MCForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def cluster(model_dir: Path) -> Any:
    """One local Ray cluster and one Serve application (two replicas) for every test."""
    # logical CPUs: two replicas of one thread, and room for the replica of a failing app.
    # The C++ CPU kernels are not under test here (float64 never uses them): off, so that no
    # replica pays for their one-off build within a request's time
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "MCSERVE_CPU_KERNELS": "0"}})
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        opts = RayServeOptions(engine={"model": str(model_dir), **ENGINE}, replicas=2,
                               imbalanced_threshold=2, shutdown_grace_s=5.0,
                               routing_stats_period_s=0.5, health_check_period_s=1.0)
        serve.run(build_serve_app(opts), name=APP, route_prefix="/")
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        yield {"client": client, "port": port, "model_dir": model_dir,
               "engine": serve.get_deployment_handle(ENGINE_DEPLOYMENT, APP),
               "ingress": serve.get_app_handle(APP)}
        client.close()
    finally:
        serve.shutdown()
        ray.shutdown()


def complete(client: Any, prompt: str, max_tokens: int = 8, **kw: Any) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    body.update(kw)
    return client.post("/v1/completions", json=body)


def replica_metric(text: str, name: str) -> dict[str, float]:
    """{replica: value} of one unlabelled-but-for-replica sample family."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and 'replica="' in line:
            labels, value = line.rsplit(" ", 1)
            rep = labels.split('replica="', 1)[1].split('"', 1)[0]
            out[rep] = out.get(rep, 0.0) + float(value)
    return out


def recompute(model_dir: Path, prompt: str, max_tokens: int) -> str:
    """The same request on a fresh in-process engine: nothing cached, everything prefilled
    (torch ops only, as in the replicas: no C++ kernel build inside this module's time)."""
    with cpu_ops.twins_only():
        eng = LLMEngine(EngineConfig(model=str(model_dir), **ENGINE))
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return LLM(engine=eng).generate([prompt], params, use_tqdm=False)[0].outputs[0].text


# ------------------------------------------------------------------------------- no cluster


def test_options_from_args_and_cli_flags(tmp_path: Path):
    o = options_from_args({"model": str(tmp_path), "replicas": "3", "cpu_threads": "2",
                           "max_num_seqs": "4", "enable_prefix_caching": "true",
                           "router": "pow2", "imbalanced-threshold": "8"})
    assert o.replicas == 3 and o.cpu_threads == 2 and o.router == "pow2"
    assert o.imbalanced_threshold == 8
    assert o.engine == {"model": str(tmp_path.resolve()), "max_num_seqs": 4,
                        "enable_prefix_caching": True}
    with pytest.raises(ValueError, match="unknown argument"):
        options_from_args({"replica": 2})
    # the entry point of `serve run` and a RayService builds without a cluster
    app = app_builder({"model": str(tmp_path), "replicas": "2", "router": "state"})
    assert isinstance(app, serve.Application)
    from mcserve.server.cli_serve import configure_serve_parser

    p = argparse.ArgumentParser()
    configure_serve_parser(p)
    a = p.parse_args(["m", "--replicas", "2", "--ray-address", "10.0.0.1:6379",
                      "--replica-threads", "4", "--router", "pow2"])
    assert (a.replicas, a.ray_address, a.replica_threads, a.router) == (
        2, "10.0.0.1:6379", 4, "pow2")
    assert p.parse_args([]).replicas is None  # the single-process server


def test_merge_metrics_labels_every_sample():
    a = ("# HELP mcserve:num_requests_running x\n# TYPE mcserve:num_requests_running gauge\n"
         "mcserve:num_requests_running 2.0\n# HELP other y\n# TYPE other gauge\nother 1.0\n")
    out = merge_metrics({"r1": a, "r2": a.replace("2.0", "5.0")}).decode()
    assert 'mcserve:num_requests_running{replica="r1"} 2.0' in out
    assert 'mcserve:num_requests_running{replica="r2"} 5.0' in out
    assert out.count("# TYPE mcserve:num_requests_running gauge") == 1
    assert "other" not in out


def test_an_export_waits_for_the_running_prefill_of_its_prefix():
    """A holder asked for a prefix that its running prefill has half computed answers after
    that prefill, with every block, rather than with half (the asker would recompute the
    rest); a prefix that nobody computes is exported at once, as it is."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2, head_dim=16,
                      segment_len=SEG, mc_top_k=1, inner_chunk=4, memory_expansion=2)
    eng = LLMEngine(EngineConfig(**{**ENGINE, "max_num_batched_tokens": 2 * SEG}),
                    model=MCForCausalLM(cfg).double())
    ids = list(range(1, 6 * SEG + 3))
    hashes = eng.prefix_hashes(ids)
    eng.add_request("r", None, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                    prompt_token_ids=ids)
    eng.step()  # two of its six segments
    assert 0 < eng.cached_prefix_blocks(hashes) < len(hashes)
    assert _export_when_computed(eng, hashes) is None
    assert _export_when_computed(eng, eng.prefix_hashes([7] * 3 * SEG)).num_blocks == 0
    while eng.has_unfinished_requests():
        eng.step()
    assert _export_when_computed(eng, hashes).num_blocks == len(hashes)


# ------------------------------------------------------------------------------- cluster


def converse(c: Any, question: str, turns: int = 3) -> tuple[str, list[str], list[int]]:
    """A conversation of ``turns`` completions, each resending the one before with its answer:
    (the last prompt, the replica of each turn, the cached tokens of each turn)."""
    conv = SYSTEM + f"User: {question}\nAssistant:"
    served, cached = [], []
    for turn in range(turns):
        r = complete(c, conv, max_tokens=12)
        assert r.status_code == 200, r.text
        served.append(r.headers[REPLICA_HEADER])
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        conv += r.json()["choices"][0]["text"] + f"\nUser: and then {turn}?\nAssistant:"
    return conv, served, cached


def test_turns_of_a_conversation_land_on_one_replica(cluster):
    c = cluster["client"]
    conv, served, cached = converse(c, "what is memory caching?")
    assert len(set(served)) == 1, served
    assert cached[0] == 0 and all(n >= len(SYSTEM) // SEG * SEG for n in cached[1:]), cached
    # streamed answers carry the header too
    r = c.post("/v1/completions", json={"prompt": conv, "max_tokens": 4, "stream": True})
    assert r.status_code == 200 and r.headers[REPLICA_HEADER] == served[0]
    assert r.text.rstrip().endswith("data: [DONE]")


def test_imbalance_falls_back_and_migrates_token_identically(cluster):
    c, model_dir = cluster["client"], cluster["model_dir"]
    prompt = SYSTEM + "User: tell me a long story about recurrent states.\nAssistant:"
    first = complete(c, prompt, max_tokens=4)  # one replica now holds the prefix
    assert first.status_code == 200
    holder = first.headers[REPLICA_HEADER]
    before = cluster["client"].get("/metrics").text
    n = 8
    with ThreadPoolExecutor(n) as pool:
        rs = list(pool.map(lambda _: complete(c, prompt, max_tokens=160), range(n)))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    where = [r.headers[REPLICA_HEADER] for r in rs]
    others = [w for w in where if w != holder]
    assert holder in where and others, where  # affinity first, then the fallback
    texts = {r.json()["choices"][0]["text"] for r in rs}
    assert len(texts) == 1  # the same greedy answer on either replica
    assert texts == {recompute(model_dir, prompt, 160)}  # ... and as a full recompute
    after = cluster["client"].get("/metrics").text
    target = others[0]
    moved = replica_metric(after, "mcserve:state_migrated_blocks_total")
    moved0 = replica_metric(before, "mcserve:state_migrated_blocks_total")
    assert moved.get(target, 0) > moved0.get(target, 0), [
        ln for ln in after.splitlines() if "migrat" in ln or "routed" in ln]
    assert replica_metric(after, "mcserve:state_migrated_bytes_total").get(target, 0) > 0
    routed = replica_metric(after, "mcserve:routed_requests_total")
    assert routed.get(target, 0) > 0
    # every request resumed from the whole cached prefix: local, or migrated to the target
    whole = (len(prompt) - 1) // SEG * SEG  # one byte per token (byte-level tokenizer)
    hits = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in rs]
    assert all(h >= whole for h in hits), (whole, hits)


def test_metrics_of_all_replicas_on_one_endpoint(cluster):
    text = cluster["client"].get("/metrics").text
    running = replica_metric(text, "mcserve:num_requests_running")
    assert len(running) == 2, text[:2000]
    assert set(replica_metric(text, "mcserve:prefix_cache_hits_total")) == set(running)
    assert "mcserve:time_to_first_token_seconds_bucket{" in text
    assert text.count("# TYPE mcserve:prefix_cache_hits counter") + text.count(
        "# TYPE mcserve:prefix_cache_hits_total counter") == 1


def test_errors_are_the_single_servers(cluster):
    c = cluster["client"]
    r = complete(c, "hi", max_tokens=100000)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"
    r = c.post("/v1/completions", json={"prompt": "hi", "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 3})
    assert r.status_code == 200 and REPLICA_HEADER in r.headers
    assert c.get("/health").status_code == 200


def test_a_model_that_cannot_load_fails_the_deployment(cluster, tmp_path: Path):
    missing = tmp_path / "missing"
    bad = RayServeOptions(engine={"model": str(missing), **ENGINE}, replicas=1, app_name="bad")
    t0 = time.monotonic()
    with pytest.raises(DeploymentFailed) as info:
        deploy(bad, route_prefix="/bad")
    assert str(info.value) == f"ValueError: MODEL: no checkpoint at {missing} (config.json missing)"
    assert time.monotonic() - t0 < 60
    serve.delete("bad")
    assert cluster["client"].get("/health").status_code == 200  # the other app is untouched


def test_a_model_without_blocks_routes_and_migrates_its_resume_points(cluster, tmp_path: Path):
    """A model served without MC (no segment blocks: resume points only): turns of one
    conversation land on one replica (routing keys of 256-token pieces), and under imbalance
    the other replica imports the holder's resume point (token-identical to a recompute)."""
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=2, head_dim=16,
                      mc_variant="none")
    none_dir = tmp_path / "none"
    MCForCausalLM(cfg).save_pretrained(none_dir)
    opts = RayServeOptions(engine={"model": str(none_dir), **ENGINE}, replicas=2,
                           app_name="none-app", imbalanced_threshold=2,
                           routing_stats_period_s=0.5, health_check_period_s=1.0)
    deploy(opts, route_prefix="/none")
    try:
        c = httpx.Client(base_url=f"http://127.0.0.1:{cluster['port']}/none", timeout=60)
        _, served, cached = converse(c, "what is a resume point?")
        assert len(set(served)) == 1, served
        assert cached[0] == 0 and all(n >= 256 for n in cached[1:]), cached
        prompt = SYSTEM + "User: tell me a long story about resume points.\nAssistant:"
        holder = complete(c, prompt, max_tokens=4).headers[REPLICA_HEADER]
        with ThreadPoolExecutor(8) as pool:
            rs = list(pool.map(lambda _: complete(c, prompt, max_tokens=160), range(8)))
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        where = [r.headers[REPLICA_HEADER] for r in rs]
        others = [w for w in where if w != holder]
        assert holder in where and others, where
        want = recompute(none_dir, prompt, 160)
        assert {r.json()["choices"][0]["text"] for r in rs} == {want}
        text = c.get("/metrics").text
        moved = replica_metric(text, "mcserve:state_migrated_resume_points_total")
        assert moved.get(others[0], 0) > 0, [ln for ln in text.splitlines() if "migrat" in ln]
        hits = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in rs]
        assert all(h >= 256 for h in hits), hits  # the grid point, local or migrated
        c.close()
    finally:
        serve.delete("none-app")


def test_a_killed_replica_fails_its_requests_with_a_retryable_503(cluster):
    c = cluster["client"]
    engine = cluster["engine"]
    results: dict[str, Any] = {}

    def long(name: str, prompt: str) -> None:
        results[name] = complete(c, prompt, max_tokens=700)

    # two long requests with distinct prompts: the second goes to the less loaded replica
    t1 = threading.Thread(target=long, args=("a", "alpha " * 40))
    t1.start()
    time.sleep(0.5)
    t2 = threading.Thread(target=long, args=("b", "bravo " * 40))
    t2.start()
    time.sleep(0.5)
    # a streamed one next to the first
    with c.stream("POST", "/v1/completions", json={
            "prompt": "alpha " * 40 + "more", "max_tokens": 700, "temperature": 0,
            "ignore_eos": True, "stream": True}) as s:
        assert s.status_code == 200, s.read()
        victim = s.headers[REPLICA_HEADER]
        info = engine.info.remote({"to": victim}).result(timeout_s=30)
        assert info["replica"] == victim
        os.kill(info["pid"], signal.SIGKILL)
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    t1.join(60)
    t2.join(60)
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2][len("data: "):])
    assert err["error"]["code"] == "unavailable" and "retry" in err["error"]["message"]
    by_replica = {r.headers.get(REPLICA_HEADER): r for r in results.values()}
    dead = [r for r in results.values() if r.status_code == 503]
    assert dead, {k: (r.status_code, r.text[:200]) for k, r in results.items()}
    for r in dead:
        body = r.json()["error"]
        assert body["code"] == "unavailable" and r.headers["Retry-After"]
    alive = [r for name, r in by_replica.items() if name and name != victim]
    assert all(r.status_code == 200 for r in alive)
    # Serve restarts it; the application answers on both replicas again
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        names = known_replicas(APP)
        if len(names) == 2 and victim not in names:
            break
        time.sleep(0.5)
    assert len(known_replicas(APP)) == 2 and victim not in known_replicas(APP)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = complete(c, "charlie " * 10, max_tokens=2)
        if r.status_code == 200:
            break
        time.sleep(0.5)
    assert r.status_code == 200


def test_no_replica_leaks_blocks(cluster):
    engine = cluster["engine"]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        stats = [engine.stats.remote({"to": n}).result(timeout_s=30)
                 for n in known_replicas(APP)]
        if all(s["pools_whole"] for s in stats):
            break
        time.sleep(0.2)
    assert len(stats) == 2 and all(s["pools_whole"] for s in stats), stats


def test_drain_answers_new_requests_503_and_lets_running_ones_finish(cluster):
    """What SIGTERM runs in ``mcserve serve --replicas``; last: the app stops accepting."""
    c = cluster["client"]
    res: dict[str, Any] = {}
    t = threading.Thread(target=lambda: res.setdefault("r", complete(c, "delta " * 30,
                                                                     max_tokens=200)))
    t.start()
    time.sleep(0.5)
    drained = cluster["ingress"].drain.remote(20.0)
    time.sleep(0.3)
    late = complete(c, "echo", max_tokens=2)
    assert late.status_code == 503 and late.json()["error"]["code"] == "unavailable"
    assert drained.result(timeout_s=60) == 0  # nothing had to be aborted
    t.join(60)
    assert res["r"].status_code == 200
