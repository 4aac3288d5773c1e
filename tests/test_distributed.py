"""Several processes, one model (jax.distributed on CPU, gloo collectives on 127.0.0.1).

Two local processes with 4 emulated devices each form the global (2, 4) ("data", "model") mesh, the layout of two
hosts. Each restores a converted tiny checkpoint with the routed experts split over both axes ("ep_global"),
reading and checking only its own half of the experts (bytes counted), runs the forward, and must match the
1-process x 8-device logits. A peer killed mid-run makes the other exit with the documented error within the
heartbeat timeout. The multi-process tests are the slow part of this file (about 10-25 s each on 2 shared cores,
most of it two interpreters importing jax and compiling). This file is also the worker:
`python tests/test_distributed.py MODE OUT_DIR [CKPT]`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERT_LEAVES = ("w13_packed", "w13_scale", "w2_packed", "w2_scale")
HEARTBEAT_S = 5
IDS = (np.arange(2 * 12).reshape(2, 12) * 7) % 1000
GEN_PROMPTS, GEN_NEW = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41], [900, 3, 77, 1]], 24


# ---- the worker (one process of the job) -------------------------------------------------------------------
def worker(mode: str, out: str, ckpt: str | None) -> None:
    from k26jax import distributed

    cluster = distributed.initialize()
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    import k26jax
    from k26jax import checkpoint, ops, sharding

    me = cluster.process_id
    mesh = sharding.make_mesh()
    if mode in ("forward", "restore"):
        impls = ops.Impls(mesh=mesh, expert_mode="ep_global")
        model = k26jax.load(ckpt, drafter=False, mesh=mesh, dtype="float32", expert_mode="ep_global", impls=impls)
        stats = checkpoint.last_read("target")
        result = {"stats": stats.__dict__, "mesh": dict(mesh.shape), "processes": cluster.num_processes}
        if mode == "forward":
            admit = json.dumps({"slot": 3, "ids": [1, 2, 3], "temperature": 0.5}).encode() if me == 0 else None
            result["admit"] = json.loads(distributed.broadcast_bytes(admit, "test/admit/0"))
            if me:
                try:
                    distributed.broadcast_bytes(None, "test/never", timeout_s=1)
                except TimeoutError as e:
                    result["timeout"] = str(e)
            from jax.experimental import multihost_utils

            with distributed.guard("forward"):
                logits = multihost_utils.process_allgather(model.logits(IDS), tiled=True)
            np.save(os.path.join(out, f"logits{me}.npy"), np.asarray(logits))
        with open(os.path.join(out, f"result{me}.json"), "w") as f:
            json.dump(result, f)
        return
    if mode == "generate":
        model = k26jax.load(ckpt, mesh=mesh, dtype="float32", expert_mode="ep_global")
        res = k26jax.generate(model, GEN_PROMPTS, max_new_tokens=GEN_NEW, budget=8)
        with open(os.path.join(out, f"result{me}.json"), "w") as f:
            json.dump({"tokens": res.tokens, "tau": res.stats["tau"]}, f)
        return
    step = jax.jit(lambda x: x.sum(0), out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    x = jax.make_array_from_callback(
        (8, 4),
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "model"))),
        lambda index: np.ones((8, 4), np.float32)[index],
    )
    with distributed.guard("warm-up step"):
        np.asarray(step(x))
    open(os.path.join(out, f"ready{me}"), "w").close()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until killed, or stopped by the peer's death
        if mode == "steps":
            with distributed.guard("step"):
                np.asarray(step(x))
        time.sleep(0.05)


# ---- launching ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(
    mode: str, out: str, ckpt: str | None = None, processes: int = 2, devices: int = 4, command=None
) -> list[subprocess.Popen]:
    """`processes` processes of one job on 127.0.0.1: this file's worker in `mode`, or `command` (python args)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    env.update(
        JAX_PLATFORMS="cpu",
        PYTHONPATH=ROOT,
        K26JAX_COORDINATOR=f"127.0.0.1:{_free_port()}",
        K26JAX_NUM_PROCESSES=str(processes),
        K26JAX_CPU_DEVICES=str(devices),
        K26JAX_HEARTBEAT_TIMEOUT_S=str(HEARTBEAT_S),
        K26JAX_INIT_TIMEOUT_S="60",
    )
    procs = []
    for i in range(processes):
        log = open(os.path.join(out, f"log{i}.txt"), "w")
        cmd = [sys.executable, *command] if command else [sys.executable, os.path.abspath(__file__), mode, out]
        cmd += [ckpt] if ckpt and not command else []
        procs.append(subprocess.Popen(cmd, env=env | {"K26JAX_PROCESS_ID": str(i)}, stdout=log, stderr=log))
    return procs


def _log(out: str, i: int) -> str:
    with open(os.path.join(out, f"log{i}.txt")) as f:
        return "\n".join(line for line in f.read().splitlines() if not line.startswith("[Gloo]"))


def _wait(procs, out: str, timeout: float = 240) -> None:
    try:
        for i, p in enumerate(procs):
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{_log(out, i)[-3000:]}"


# ---- tests -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny K2.6-format checkpoint (make_tiny), converted (chunks cut for 8 devices: 2 experts a chunk)."""
    base = tmp_path_factory.mktemp("dist")
    hf_dir, out = str(base / "hf"), str(base / "orbax")
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    for cmd in (
        ["-m", "convert.make_tiny", "--out", hf_dir, "--no-drafter"],
        ["-m", "convert", "--hf", hf_dir, "--out", out, "--dtype", "float32", "--no-progress"],
    ):
        subprocess.run([sys.executable, *cmd], check=True, env=env, cwd=ROOT, capture_output=True)
    return out


def _share(ckpt: str, process: int, processes: int) -> int:
    """Bytes of the chunk files one process holds under "ep_global" on a (processes, n) mesh: every chunk of the
    leaves split over "model" or replicated, and its 1/processes of the routed-expert chunks."""
    from k26jax import checkpoint

    manifest = checkpoint.read_manifest(ckpt)
    total = 0
    for name, leaf in manifest["leaves"].items():
        chunk_bytes = int(np.prod(leaf["chunks"])) * checkpoint.np_dtype(leaf["dtype"]).itemsize
        keys = list(leaf["chunk_sha256"])
        if name.rsplit(".", 1)[-1] in EXPERT_LEAVES:
            per = leaf["shape"][1] // leaf["chunks"][1] // processes  # expert chunks a process holds
            keys = [k for k in keys if int(k.split(".")[1]) // per == process]
        total += len(keys) * chunk_bytes
    return total


def _rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_mesh_layout_one_process():
    """One process: make_mesh is the (1, n) mesh it always was; data=2 gives the two-host layout on one host;
    "ep_global" fitted to a (1, n) mesh is exactly "ep"."""
    import jax
    from jax.sharding import PartitionSpec as P

    from k26jax import sharding
    from k26jax.config import preset

    mesh = sharding.make_mesh()
    assert dict(mesh.shape) == {"data": 1, "model": 8} and list(mesh.devices.flat) == jax.devices()
    assert dict(sharding.make_mesh(8, data=2).shape) == {"data": 2, "model": 4}
    with pytest.raises(ValueError, match="data=3"):
        sharding.make_mesh(8, data=3)
    cfg = preset("tiny")
    ep, glob = (sharding.param_partition_specs(cfg, m) for m in ("ep", "ep_global"))
    assert glob["moe"]["mlp"]["w13_packed"] == P(None, ("data", "model"), None, None, None)
    for spec_ep, spec_glob, shape in (
        (ep["moe"]["mlp"][k], glob["moe"]["mlp"][k], (3, 16, 32, 2, 256)[: len(ep["moe"]["mlp"][k])])
        for k in EXPERT_LEAVES
    ):
        assert sharding.fit_spec(spec_glob, shape, mesh) == sharding.fit_spec(spec_ep, shape, mesh)
    two = sharding.make_mesh(8, data=2)
    assert sharding.fit_spec(P(None, ("data", "model")), (3, 16), two) == P(None, ("data", "model"))
    assert sharding.fit_spec(P(None, ("data", "model")), (3, 12), two) == P(None, None)  # 8 does not divide 12
    assert sharding.EXPERT_MODES == ("ep", "tp")  # the single-host layouts the tools offer are unchanged
    assert sharding.expert_partition_specs("ep_global")["w2_packed"] == P(None, ("data", "model"), None, None)


def test_initialize_one_process_and_bad_environment(monkeypatch):
    """No coordinator and no launcher: one process, nothing started. A partial configuration is refused."""
    from k26jax import distributed

    explicit = (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID)
    for var in explicit + distributed.LAUNCHER_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(distributed, "_CLUSTER", None)
    cluster = distributed.initialize()
    assert (cluster.process_id, cluster.num_processes, cluster.coordinator) == (0, 1, None) and cluster.is_coordinator
    monkeypatch.setattr(distributed, "_CLUSTER", None)
    monkeypatch.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:1")
    with pytest.raises(ValueError, match="go together"):
        distributed.initialize()
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "two")
    with pytest.raises(ValueError, match="K26JAX_NUM_PROCESSES='two'"):
        distributed.initialize()
    monkeypatch.setattr(distributed, "_CLUSTER", None)


@pytest.mark.parametrize(
    "env,want",
    [
        ({"K26JAX_COORDINATOR": "10.0.0.1:9", "K26JAX_NUM_PROCESSES": "2", "K26JAX_PROCESS_ID": "1"}, None),
        (
            {"SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "CUDA_VISIBLE_DEVICES": "0,1,2"},
            [0, 1, 2],
        ),
        (
            {"SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "CUDA_VISIBLE_DEVICES": "0,1,2"},
            None,
        ),
        ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "K26JAX_LOCAL_DEVICE_IDS": "4,5"}, [4, 5]),
    ],
)
def test_what_initialize_asks_of_jax(monkeypatch, env, want):
    """Explicit K26JAX_* settings turn jax's launcher detection off; under a launcher that starts one process a host,
    the process gets every GPU of the host (jax alone would give it its local rank's one); several a host: jax's."""
    import jax

    from k26jax import distributed

    for var in ("K26JAX_COORDINATOR", "K26JAX_NUM_PROCESSES", "K26JAX_PROCESS_ID", "K26JAX_LOCAL_DEVICE_IDS"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(distributed, "_CLUSTER", None)
    distributed.initialize(heartbeat_timeout_s=7)
    monkeypatch.setattr(distributed, "_CLUSTER", None)
    (kw,) = calls
    assert kw["local_device_ids"] == want and kw["heartbeat_timeout_seconds"] == 7
    explicit = "K26JAX_COORDINATOR" in env
    assert kw["cluster_detection_method"] == ("deactivate" if explicit else None)
    assert (kw["coordinator_address"], kw["process_id"]) == (("10.0.0.1:9", 1) if explicit else (None, None))


def test_two_processes_read_their_half_and_match_one_process(ckpt, tmp_path):
    """(slow: two processes) Each process restores only its half of the routed experts, and checks only those
    chunks; both give the logits of the 1-process x 8-device run. Process 0's bytes reach process 1 through the
    key-value store; a key never published is a TimeoutError, not a hang."""
    import k26jax
    from k26jax import checkpoint, ops, sharding

    procs = _launch("forward", str(tmp_path), ckpt)
    mesh = sharding.make_mesh(8)  # meanwhile, the single-process reference
    one = k26jax.load(ckpt, drafter=False, mesh=mesh, dtype="float32", impls=ops.Impls(mesh=mesh)).logits(IDS)
    everything = checkpoint.last_read("target")
    _wait(procs, str(tmp_path))
    assert everything.bytes_read == _share(ckpt, 0, 1)
    results = [json.load(open(tmp_path / f"result{i}.json")) for i in range(2)]
    for i, result in enumerate(results):
        stats = result["stats"]
        assert result["mesh"] == {"data": 2, "model": 4} and stats["process_index"] == i
        assert stats["bytes_read"] == stats["chunk_bytes"] == _share(ckpt, i, 2), stats
        assert stats["verified"] == stats["chunk_files"] == stats["file_reads"]
    expert_bytes = everything.bytes_read - _share(ckpt, 0, 2) + everything.bytes_read - _share(ckpt, 1, 2)
    assert expert_bytes > 0.3 * everything.bytes_read  # the halves are a real saving: the experts dominate
    assert results[0]["admit"] == results[1]["admit"] == {"slot": 3, "ids": [1, 2, 3], "temperature": 0.5}
    assert "timeout" not in results[0] and "'test/never' within 1 s" in results[1]["timeout"]
    for i in range(2):
        got = np.load(tmp_path / f"logits{i}.npy")
        assert got.shape == (2, 12, 1024) and _rel_err(got, one) < 1e-5, _rel_err(got, one)


def test_two_processes_generate_the_single_process_tokens(tmp_path):
    """(slow: two processes) Multi-controller `generate`: both processes run the same jitted DDTree steps on the
    global (2, 4) mesh and return the tokens of the 1-process x 8-device run (float32, greedy)."""
    import k26jax
    from k26jax import sharding

    tiny = os.path.join(ROOT, "checkpoints", "tiny")
    procs = _launch("generate", str(tmp_path), tiny)
    model = k26jax.load(tiny, mesh=sharding.make_mesh(8), dtype="float32", expert_mode="ep")
    want = k26jax.generate(model, GEN_PROMPTS, max_new_tokens=GEN_NEW, budget=8).tokens
    _wait(procs, str(tmp_path))
    for i in range(2):
        got = json.load(open(tmp_path / f"result{i}.json"))["tokens"]
        assert got == want, (i, got, want)


def test_a_two_process_server_answers_from_process_0_as_one_process_would(tmp_path):
    """(slow: two processes) `k26jax serve` under K26JAX_* on two processes: process 0 serves HTTP and leads, process
    1 follows its calls. A completion through the openai client equals the 1-process x 8-device greedy tokens;
    SIGTERM stops process 0, which stops its follower. (The auto budget's calls: test_serve_multihost.py.)"""
    import openai

    import k26jax
    from k26jax import sharding
    from k26jax.tokenizer import StreamDecoder

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve = ["-m", "k26jax", "serve", "--ckpt", os.path.join(ROOT, "checkpoints", "tiny"), "--dtype", "float32"]
    serve += ["--port", str(port), "--budget", "8", "--max-batch", "2", "--max-len", "32", "--log-level", "warning"]
    procs = _launch("serve", str(tmp_path), command=serve)
    model = k26jax.load(os.path.join(ROOT, "checkpoints", "tiny"), mesh=sharding.make_mesh(8), dtype="float32")
    want = k26jax.generate(model, GEN_PROMPTS[:2], max_new_tokens=12, budget=8).tokens
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
    deadline = time.monotonic() + 400
    while True:
        assert all(p.poll() is None for p in procs), _log(str(tmp_path), 0)[-3000:] + _log(str(tmp_path), 1)[-3000:]
        try:
            client.models.list()
            break
        except openai.APIConnectionError:
            assert time.monotonic() < deadline, "the server never came up"
            time.sleep(1)
    for prompt, tokens in zip(GEN_PROMPTS[:2], want):
        res = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        stream = StreamDecoder(model.tokenizer)
        assert res.usage.completion_tokens == len(tokens)
        text = stream.feed([t for t in tokens if t not in model.cfg.eos_token_ids])
        assert res.choices[0].text == text + stream.flush()
    procs[0].send_signal(signal.SIGTERM)
    _wait(procs, str(tmp_path), timeout=120)


def test_each_process_checks_only_its_own_chunks(ckpt, tmp_path):
    """(slow: two processes) A damaged expert chunk in process 1's half: process 1 refuses it naming the file,
    process 0 never reads it and loads."""
    from k26jax import checkpoint

    damaged = str(tmp_path / "ckpt")
    shutil.copytree(ckpt, damaged)
    leaf = checkpoint.read_manifest(damaged)["leaves"]["moe.mlp.w13_packed"]
    last = leaf["shape"][1] // leaf["chunks"][1] - 1  # the last expert chunk: process 1's
    path = os.path.join(damaged, "params", "moe.mlp.w13_packed", f"0.{last}.0.0.0")
    with open(path, "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 1]))
    out = tmp_path / "out"
    out.mkdir()
    procs = _launch("restore", str(out), damaged)
    for p in procs:
        p.wait(timeout=240)
    assert procs[0].returncode == 0, _log(str(out), 0)[-3000:]
    assert procs[1].returncode != 0
    assert "CorruptCheckpointError" in _log(str(out), 1) and f"0.{last}.0.0.0: corrupted" in _log(str(out), 1)
    stats = json.load(open(out / "result0.json"))["stats"]
    assert stats["bytes_read"] == _share(damaged, 0, 2)


@pytest.mark.parametrize("survivor_mode", ["steps", "idle"])
def test_a_dead_peer_stops_the_other_within_the_timeout(tmp_path, survivor_mode):
    """(slow: two processes) Process 1 is killed. A process inside a collective step fails it at once and exits
    with EXIT_PEER_LOST and a PeerLostError line; an idle one is terminated by jax's coordination service after the
    heartbeat timeout (SIGABRT, its documented message). Neither hangs. One device a process: with several, the
    process's other gloo ranks can wait on the failed one until the coordination service ends it (the idle path)."""
    from k26jax import distributed

    procs = _launch(survivor_mode, str(tmp_path), devices=1)
    try:
        deadline = time.monotonic() + 180
        while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), _log(str(tmp_path), 0)
            time.sleep(0.1)
        procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        procs[0].wait(timeout=6 * HEARTBEAT_S + 30)
        elapsed = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = _log(str(tmp_path), 0)
    if survivor_mode == "steps":
        assert procs[0].returncode == distributed.EXIT_PEER_LOST, text[:3000]
        assert "PeerLostError: k26jax: process 0 of 2: step failed because another process" in text
        assert elapsed < HEARTBEAT_S, elapsed
    else:
        assert procs[0].returncode == -signal.SIGABRT, text[:3000]
        assert "Terminating process because the JAX distributed service detected fatal errors" in text
        assert elapsed < 3 * HEARTBEAT_S + 10, elapsed


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
