"""`dsq serve --tp N`: the model split over N ranks (runtime/tp.py), one process each, on
torch.distributed: gloo on the CPU, NCCL on GPUs (rank r on GPU r, NVLink multicast off).

Rank 0 is the server: its HTTP loop and its engine (serve/engine.py) schedule every step. Its
paged cache (`LeaderKV`) sends each step's inputs (token ids, positions, block tables: the call
PagedKV.forward or forward_rows takes) to the other ranks before running it; each of them
(`follow`) runs the same call over its own pool, of the same blocks, holding its own heads'
keys and values. The layers' all-reduces keep the ranks in step. The steps' inputs travel over a
gloo group of their own, on the CPU, so a rank waiting for the next step holds no GPU collective
open while the server idles.

Rank 0 starts the others (`python -m dsq.serve.tp`) and ends them when it stops; a rank that
fails to load stops them all with its error.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from dsq.errors import DsqError
from dsq.serve.paged import PagedKV

# a rank waits for the next step as long as the server idles: weeks, not gloo's default 30 minutes
IDLE_TIMEOUT = timedelta(days=30)
# the ranks' rendezvous and their step's collectives: loading a rank's shard comes before the first
STEP_TIMEOUT = timedelta(minutes=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Group:
    """This process's rank among `world` on torch.distributed: the default group for the layers'
    all-reduces (NCCL on GPUs, gloo on the CPU), and a gloo group for the steps' inputs."""

    def __init__(self, rank: int, world: int, port: int, cuda: bool):
        self.rank, self.world, self.cuda = rank, world, cuda
        if cuda:
            os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off (issue 42)
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=STEP_TIMEOUT)
        self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.backend = dist.get_backend()

    def send(self, message) -> None:
        """Rank 0: `message` (any picklable value) to every other rank."""
        dist.broadcast_object_list([message], src=0, group=self.control)

    def receive(self):
        """Another rank: rank 0's next message."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def ready(self, error: str | None) -> None:
        """Every rank's load went well (error None), or a DsqError with the first rank's error."""
        errors = [None] * self.world
        dist.all_gather_object(errors, error, group=self.control)
        bad = [(r, e) for r, e in enumerate(errors) if e]
        if bad:
            r, e = bad[0]
            raise DsqError(f"--tp: rank {r} could not load the model: {e}" if r != self.rank else e)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class LeaderKV(PagedKV):
    """Rank 0's pool: each forward or forward_rows call goes to the other ranks first (the same
    arguments), then runs here."""

    def __init__(self, group: Group, model, num_blocks: int, block_size: int, max_len: int, dtype=None):
        super().__init__(model, num_blocks, block_size, max_len, dtype)
        self.group, self._inside = group, False
        group.send(("pool", (num_blocks, block_size, max_len, dtype)))

    def forward(self, *args, **kw):
        return self._everywhere("forward", args, kw)

    def forward_rows(self, *args, **kw):
        return self._everywhere("forward_rows", args, kw)

    def _everywhere(self, name: str, args: tuple, kw: dict):
        if self._inside:  # (forward_rows runs forward: one message for both)
            return getattr(PagedKV, name)(self, *args, **kw)
        self.group.send((name, args, kw))
        self._inside = True
        try:
            return getattr(PagedKV, name)(self, *args, **kw)
        finally:
            self._inside = False


class Ranks:
    """Rank 0's view of the ranks: the group, and the other ranks' processes."""

    def __init__(self, group: Group, procs: list):
        self.group, self.procs = group, procs
        self.following = False  # the other ranks loaded their shares and wait for steps

    def leader(self, model, num_blocks: int, block_size: int, max_len: int, dtype=None) -> LeaderKV:
        return LeaderKV(self.group, model, num_blocks, block_size, max_len, dtype)

    def close(self) -> None:
        """Stop the other ranks (after their last step) and leave the group."""
        try:
            if self.following:
                self.following = False
                self.group.send(None)
        except (RuntimeError, OSError):  # the others are gone already (their service stopped them too)
            pass
        finally:
            for p in self.procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
            self.group.close()


def start(world: int, cuda: bool, load_kw: dict, console=None) -> tuple[Ranks, object]:
    """Start ranks 1..world-1, join them as rank 0, and load rank 0's share of the model
    (runtime.engine.load with `load_kw`, `plan`'s and the model's own; `console` for rank 0's
    progress); every rank's load succeeded, or DsqError. Returns the ranks and rank 0's model."""
    import base64
    import pickle

    port = _free_port()
    spec = base64.b64encode(pickle.dumps(load_kw)).decode()
    procs = [subprocess.Popen([sys.executable, "-m", "dsq.serve.tp", str(r), str(world), str(port), str(int(cuda)),
                               spec]) for r in range(1, world)]
    try:
        group = Group(0, world, port, cuda)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    ranks = Ranks(group, procs)
    try:
        nm, error = _load(0, world, {**load_kw, "console": console})
        group.ready(error)
        ranks.following = True
    except BaseException:
        ranks.close()
        raise
    return ranks, nm


def _load(rank: int, world: int, load_kw: dict):
    """(this rank's model, None), or (None, its one-line error)."""
    from dsq.runtime.engine import load

    try:
        return load(**load_kw, tp=(rank, world)), None
    except DsqError as e:
        return None, e.one_line()
    except Exception as e:  # noqa: BLE001 - every rank must hear of it, or they wait for a step for good
        traceback.print_exc()
        return None, f"{type(e).__name__}: {e}"


def _rank_main(rank: int, world: int, port: int, cuda: bool, load_kw: dict) -> None:
    """Rank 1.. : load this rank's share, then run rank 0's steps until it says stop. Ctrl-C
    reaches every process of the terminal: rank 0 alone acts on it, and stops this one."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("DSQ_QUIET", "1")
    group = Group(rank, world, port, cuda)
    try:
        nm, error = _load(rank, world, load_kw)
        group.ready(error)
        follow(group, nm)
    except DsqError:
        pass  # rank 0 says it
    except Exception:  # noqa: BLE001 - a step failed here: rank 0's next collective fails with it
        traceback.print_exc()
        sys.exit(1)
    finally:
        group.close()


def follow(group: Group, nm) -> None:
    """Run rank 0's steps over this rank's pool until rank 0 sends None."""
    from dsq.kernels import cpu

    torch.set_grad_enabled(False)
    torch.set_num_threads(nm.n_threads)
    if cpu.available():
        cpu.set_threads(nm.n_threads)
    nm.cache = None
    kv = None
    while (message := group.receive()) is not None:
        name, *call = message
        if name == "pool":
            kv = PagedKV(nm.model, *call[0])
            continue
        args, kw = call
        getattr(kv, name)(*args, **kw)


def plan(world: int, model, *, gpu_layers: str, threads: int | None, console=None,
         revision: str | None = None) -> tuple[dict, bool]:
    """Check `--tp world` for MODEL before any rank starts: (the load options every rank shares,
    whether the ranks run on GPUs). One line of error for a bad count, a model whose heads do not
    split over it, more ranks than GPUs, or a model split between the CPU and a GPU."""
    from dsq.runtime import tp as tensor_parallel
    from dsq.runtime.model_ref import resolve_model
    from dsq.runtime.threads import default_threads

    if world < 1:
        raise DsqError(f"--tp must be at least 1, got {world}", "pass --tp 2 or more to split the model over ranks")
    ref = resolve_model(model, console, revision)
    tensor_parallel.check(world, model_args(ref))
    cuda = gpu_layers.strip() != "0" and torch.cuda.is_available()
    if cuda:
        if gpu_layers.strip() != "all":
            raise DsqError(f"--tp splits every layer over the GPUs, and --gpu-layers {gpu_layers} leaves some on "
                           "the CPU", "pass --gpu-layers all (or leave it out to split over CPU processes)")
        n = torch.cuda.device_count()
        if world > n:
            raise DsqError(f"--tp {world} needs {world} GPUs, this machine has {n}",
                           f"pass --tp {n} or fewer" if n > 1 else "leave --tp out")
    if threads is None and not cuda:  # the ranks share the cores
        threads = max(1, default_threads() // world)
    # head "cpu": on the CPU ranks the head stays in RAM with the layers, not alone on a GPU
    return {"model": ref, "backend": "native", "gpu_layers": gpu_layers if cuda else "0", "threads": threads,
            "head": "cpu"}, cuda


def model_args(ref):
    """The ModelArgs of a GGUF file or HF directory, from its metadata or config.json."""
    from dsq.models.registry import build_args

    if ref.kind == "gguf":
        from dsq.convert.gguf_to_hf import hf_config_from_gguf
        from dsq.formats.gguf_file import GGUFFile
        from dsq.models.registry import arch_for_gguf

        g = GGUFFile(ref.path)
        cfg, where = hf_config_from_gguf(g, arch_for_gguf(g.arch), "float32"), f"{ref.path.name} (GGUF metadata)"
    else:
        from dsq.formats.hf import HFModelDir

        cfg, where = HFModelDir(ref.path).config, f"{ref.path}/config.json"
    return build_args(cfg, where)[1]


if __name__ == "__main__":
    import base64
    import pickle

    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), bool(int(sys.argv[4])),
               pickle.loads(base64.b64decode(sys.argv[5])))
