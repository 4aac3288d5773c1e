"""Several processes, one model: a thin layer over jax.distributed (multi-controller JAX).

Every process runs the same program on its own devices; `initialize` joins them before jax touches a device, and
`sharding.make_mesh` then lays one global mesh over all of them (one "data" row per process). Configuration comes
from the arguments, else the environment:
  K26JAX_COORDINATOR      host:port of process 0's coordination service (every process gives the same)
  K26JAX_NUM_PROCESSES    how many processes
  K26JAX_PROCESS_ID       this process, 0 .. n-1
  K26JAX_INIT_TIMEOUT_S   how long to wait for every process to join (default 300)
  K26JAX_HEARTBEAT_TIMEOUT_S  how long a silent peer counts as alive (default 60)
  K26JAX_LOCAL_DEVICE_IDS this process's GPUs, "0,1,..." (default: every GPU of the host)
  K26JAX_CPU_DEVICES      CPU only: emulated devices per process (the tests' single-host multi-process form)
Without the first three, jax's own detection runs under SLURM, Open MPI and the other launchers it knows (or when
JAX_COORDINATOR_ADDRESS is set); with none of these, `initialize` leaves the process alone (one process). The
layout wants one process per host owning all of its GPUs (SLURM: --ntasks-per-node=1); where the launcher starts
one process a host, `initialize` gives it every GPU of the host (jax's detection alone would give it only the GPU of
its local rank). With a process per GPU, make_mesh has one GPU a row: no tensor parallelism.

A dead peer never hangs the others. A collective that needs it fails at once when the transport notices (gloo on
CPU: "Connection closed by peer"; `guard` turns that into PeerLostError and exits). A process that is not in a
collective, or whose collective cannot notice (a host that vanished from the network; gloo with several CPU
devices a process, whose other ranks can wait on the failed one), is terminated by jax's
coordination service once the peer has missed heartbeats for heartbeat_timeout_s seconds: it aborts (SIGABRT, exit
134) with "Terminating process because the JAX distributed service detected fatal errors". Either way every
process stops within heartbeat_timeout_s (plus the time to notice); multi-controller JAX cannot go on with fewer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys

import jax

ENV_COORDINATOR = "K26JAX_COORDINATOR"
ENV_NUM_PROCESSES = "K26JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "K26JAX_PROCESS_ID"
ENV_INIT_TIMEOUT = "K26JAX_INIT_TIMEOUT_S"
ENV_HEARTBEAT_TIMEOUT = "K26JAX_HEARTBEAT_TIMEOUT_S"
ENV_LOCAL_DEVICE_IDS = "K26JAX_LOCAL_DEVICE_IDS"
ENV_CPU_DEVICES = "K26JAX_CPU_DEVICES"
INIT_TIMEOUT_S, HEARTBEAT_TIMEOUT_S = 300, 60
# Launchers jax.distributed detects by itself (jax/_src/clusters): SLURM, Open MPI, and an explicit coordinator.
LAUNCHER_ENV = ("SLURM_STEP_NODELIST", "OMPI_COMM_WORLD_SIZE", "OMPI_MCA_orte_hnp_uri", "JAX_COORDINATOR_ADDRESS")
EXIT_PEER_LOST = 75  # `guard`'s exit status (EX_TEMPFAIL): a peer process died; restart the whole job
# Words of a runtime error that a collective's transport or the coordination service gives when a peer is gone
# (specific ones: any other NCCL or runtime error is a real failure and keeps its traceback).
PEER_LOST_MARKERS = (
    "Gloo",
    "ncclRemoteError",
    "remote process exited",
    "Connection closed by peer",
    "Connection reset",
    "heartbeat",
    "coordination service",
)
log = logging.getLogger(__name__)


class PeerLostError(RuntimeError):
    """A collective failed because another process of the job died or became unreachable."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    """This process's place in the job."""

    process_id: int
    num_processes: int
    coordinator: str | None  # None: one process, jax.distributed not started
    heartbeat_timeout_s: int
    init_timeout_s: int

    @property
    def is_coordinator(self) -> bool:
        return self.process_id == 0


_CLUSTER: Cluster | None = None


def _env_int(name: str, given: int | None) -> int | None:
    if given is not None:
        return given
    raw = os.environ.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer") from None


def _host_gpus() -> list[int] | None:
    """Every GPU of this host as CUDA ordinals (after CUDA_VISIBLE_DEVICES), or None when there is none."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        n = len([v for v in visible.split(",") if v.strip()])
    else:
        n = (
            sum(1 for f in os.listdir("/dev") if f.startswith("nvidia") and f[6:].isdigit())
            if os.path.isdir("/dev")
            else 0
        )
    return list(range(n)) or None


def _launcher_processes_per_host() -> int | None:
    """Processes the launcher starts on each host, when it says (SLURM inside srun, Open MPI); else None."""
    steps = os.environ.get("SLURM_STEP_TASKS_PER_NODE")  # e.g. "1(x2)" or "8(x2),4"
    if steps:
        return max(int(part.split("(")[0]) for part in steps.split(","))
    local = os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    return int(local) if local else None


def _device_ids(given) -> list[int] | None:
    raw = given if given is not None else os.environ.get(ENV_LOCAL_DEVICE_IDS)
    if raw is None or raw == "":
        return None
    if isinstance(raw, str):
        try:
            return [int(v) for v in raw.split(",")]
        except ValueError:
            raise ValueError(f"{ENV_LOCAL_DEVICE_IDS}={raw!r}: expected device ids like 0,1,2,3") from None
    return list(raw)


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: list[int] | None = None,
    init_timeout_s: int | None = None,
    heartbeat_timeout_s: int | None = None,
    cpu_devices: int | None = None,
) -> Cluster:
    """Joins this process to the job (jax.distributed.initialize); call it before anything touches a device.

    Arguments override the K26JAX_* variables (module docstring). A coordinator with a process count and id: those
    are used. None of them but a known launcher (SLURM, Open MPI, JAX_COORDINATOR_ADDRESS): jax detects them. No
    launcher either: a single process, nothing started. init_timeout_s bounds the wait for every process to join
    (an error naming the coordinator, not a hang); heartbeat_timeout_s bounds how long a dead peer goes unnoticed.
    local_device_ids: this process's GPUs (default: all of the host's). cpu_devices (CPU only): emulated devices
    in this process. Calling it again returns the same Cluster.
    """
    global _CLUSTER
    if _CLUSTER is not None:
        return _CLUSTER
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR) or None
    num_processes = _env_int(ENV_NUM_PROCESSES, num_processes)
    process_id = _env_int(ENV_PROCESS_ID, process_id)
    init_timeout = _env_int(ENV_INIT_TIMEOUT, init_timeout_s) or INIT_TIMEOUT_S
    heartbeat = _env_int(ENV_HEARTBEAT_TIMEOUT, heartbeat_timeout_s) or HEARTBEAT_TIMEOUT_S
    cpu_devices = _env_int(ENV_CPU_DEVICES, cpu_devices)
    device_ids = _device_ids(local_device_ids)
    if cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    explicit = (coordinator, num_processes, process_id)
    if any(v is not None for v in explicit) and None in explicit:
        raise ValueError(
            f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} go together; got coordinator="
            f"{coordinator!r}, num_processes={num_processes!r}, process_id={process_id!r}"
        )
    if coordinator is None and not any(os.environ.get(k) for k in LAUNCHER_ENV):
        _CLUSTER = Cluster(0, 1, None, heartbeat, init_timeout)
        return _CLUSTER
    if num_processes == 1:
        _CLUSTER = Cluster(0, 1, None, heartbeat, init_timeout)
        return _CLUSTER
    # On CPU the cross-process collectives are gloo over TCP (jax's default in 0.11; set so that an older or
    # differently configured jax does not silently have none).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    one_per_host = _launcher_processes_per_host() == 1
    if coordinator is None and device_ids is None and one_per_host and not os.environ.get("JAX_LOCAL_DEVICE_IDS"):
        device_ids = _host_gpus()  # else jax's launcher detection gives each process only its local rank's GPU
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            local_device_ids=device_ids,
            cluster_detection_method="deactivate" if coordinator is not None else None,
            initialization_timeout=init_timeout,
            heartbeat_timeout_seconds=heartbeat,
        )
    except Exception as e:
        where = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS") or "the launcher's coordinator"
        raise RuntimeError(
            f"k26jax.distributed.initialize: process {process_id} could not join the job at {where} within "
            f"{init_timeout} s ({ENV_INIT_TIMEOUT}): are all {num_processes or 'the'} processes started with the "
            f"same {ENV_COORDINATOR} and distinct {ENV_PROCESS_ID}s, and is the port reachable from every host? "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from e
    _CLUSTER = Cluster(jax.process_index(), jax.process_count(), coordinator or "auto", heartbeat, init_timeout)
    log.info(
        "k26jax.distributed: process %d of %d, %d local of %d devices (coordinator %s, heartbeat timeout %d s)",
        _CLUSTER.process_id,
        _CLUSTER.num_processes,
        jax.local_device_count(),
        jax.device_count(),
        _CLUSTER.coordinator,
        heartbeat,
    )
    return _CLUSTER


def cluster() -> Cluster:
    """This process's Cluster (a single process when `initialize` was never called)."""
    return _CLUSTER or Cluster(0, 1, None, HEARTBEAT_TIMEOUT_S, INIT_TIMEOUT_S)


def is_peer_lost(error: BaseException) -> bool:
    """Whether a runtime error of a multi-process run says a peer is gone (see PEER_LOST_MARKERS)."""
    text = str(error)
    # jax raises a collective's transport failure as JaxRuntimeError or, for some status codes, ValueError.
    return (
        jax.process_count() > 1
        and isinstance(error, (jax.errors.JaxRuntimeError, ValueError))
        and any(m in text for m in PEER_LOST_MARKERS)
    )


@contextlib.contextmanager
def guard(what: str = "step", *, exit: bool = True):
    """Around a step's collectives: a failure because a peer died becomes PeerLostError naming this process, the
    job and the cause. exit=True (default) then logs it to stderr and ends the process with EXIT_PEER_LOST at once,
    instead of waiting heartbeat_timeout_s in jax's shutdown barrier for a peer that will never come."""
    try:
        yield
    except (jax.errors.JaxRuntimeError, ValueError) as e:
        if not is_peer_lost(e):
            raise
        c = cluster()
        err = PeerLostError(
            f"k26jax: process {jax.process_index()} of {jax.process_count()}: {what} failed because another "
            f"process of the job is gone ({str(e).splitlines()[0]}). The job cannot continue with fewer processes: "
            f"restart all of them. Processes not in a collective are stopped by the coordination service within "
            f"heartbeat_timeout_s={c.heartbeat_timeout_s} s."
        )
        if not exit:
            raise err from e
        print(f"PeerLostError: {err}", file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_LOST)


def broadcast_bytes(payload: bytes | None, key: str, *, timeout_s: float | None = None) -> bytes:
    """Process 0's `payload` on every process, through the coordination service's key-value store: what must reach
    all processes before a step (a server's admissions, frees and sampling parameters). Process 0 passes the bytes
    and gets them back; the others pass None and wait for them at most timeout_s (default heartbeat_timeout_s),
    then TimeoutError naming the key. Keys are write-once: use one per step (f"admit/{step}"); once every process
    has run the step that followed, all have read it and process 0 may `forget` it. One process: payload as is."""
    if jax.process_count() == 1:
        return payload
    client = _client()
    if jax.process_index() == 0:
        if payload is None:
            raise ValueError("broadcast_bytes: process 0 must pass the payload")
        client.key_value_set_bytes(f"k26jax/{key}", payload)
        return payload
    timeout_s = cluster().heartbeat_timeout_s if timeout_s is None else timeout_s
    try:
        return client.blocking_key_value_get_bytes(f"k26jax/{key}", int(timeout_s * 1000))
    except jax.errors.JaxRuntimeError as e:
        if "DEADLINE_EXCEEDED" not in str(e):
            raise
        raise TimeoutError(
            f"k26jax: process {jax.process_index()}: nothing from process 0 under {key!r} within {timeout_s} s; "
            f"is process 0 alive and at the same step?"
        ) from e


def forget(key: str) -> None:
    """Process 0: drop a key `broadcast_bytes` published (every process has read it). Elsewhere: nothing."""
    if jax.process_count() > 1 and jax.process_index() == 0:
        _client().key_value_delete(f"k26jax/{key}")


def _client():
    """The distributed runtime client (its key-value store). jax 0.11 has no public accessor; this is the object
    jax.experimental.multihost_utils itself uses."""
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client
