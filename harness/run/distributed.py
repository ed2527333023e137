"""A run sharded over several processes through torch.distributed (issue #14): NCCL on GPUs, gloo on CPUs.

The layer-major lockstep splits cleanly by stack. At every layer:

1. the last rank produces the reference's pass (its output streams and every recorded tap) and broadcasts it: the
   reference runs once per layer, whatever the number of ranks. The deal of the pairs leaves that rank room for
   it, and once its own pairs are done it runs the next layers' references (`reference_lead`: two ahead on a CPU,
   one on a GPU) while the others finish theirs, so the reference costs the run no time of its own when that rank's
   share leaves room for it;
2. each rank runs its share of the (stack, mode) pairs against those taps — dealt by their cost so the ranks finish
   a layer together (`RunSpec.stacks_of_rank`, harness.run.deal), fixed for the run, so a stack's global mode, which
   carries its own streams from layer to layer, always runs on the same rank, and any number of ranks works;
3. the rows, the new NaN/Inf findings and the dumped tensors are gathered to rank 0, which writes the layer in the
   order a single process writes it; the findings reach every rank (a stack's logits check reads them).

The run directory is rank 0's alone, written as a one-process run writes it, so `--resume` works the same and a
sharded run's metrics.parquet equals a one-process run's (each stack computes on the same inputs in the same
order). The final logits are compared by the rank that holds each stack's streams. The resume state gathers every
stack's streams to rank 0 when it is due.

`launch` starts the ranks as local processes (`dsv4-drift run --devices N`); under `torchrun`, `from_environment`
joins the group torchrun describes. A rank that dies stops the others (`launch` ends them) and the run fails with a
message naming it; the layers written so far stay valid.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import socket
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import reduce_tensor

from harness.run.host_allocator import keep_freed_host_memory
from harness.run.layer_log import LayerLog
from harness.run.probes import Finding
from harness.run.runner import LockstepRunner, ReferencePass, RunSpec, VariantSpec
from harness.run.setup import load_registry, scenario_from_manifest, spec_from_manifest
from harness.run.store import RunStore
from reference.weights.source import TensorBundle

ALIGN = 8
"""Tensors travel as bytes in one buffer per broadcast, each starting at a multiple of 8 bytes (the largest element
size sent), so every one can be viewed back in its own dtype."""


@dataclass(frozen=True)
class Group:
    """This process's place in the run: rank, number of ranks, its device, and how many ranks share that device."""

    rank: int
    world: int
    device: str
    ranks_per_device: int = 1

    @property
    def one_gpu(self) -> bool:
        """Every rank on the same GPU: tensors then pass by CUDA IPC (a handle to src's buffer), not through gloo,
        which would copy them to the host and back (~6 GB of reference taps per Flash layer at 30K tokens)."""
        return self.device.startswith("cuda") and self.world > 1 and self.ranks_per_device == self.world

    def leave(self) -> None:
        """End this rank's part once every rank's share is done: a barrier, then the group destroyed. Under torchrun
        a rank otherwise exits with its group alive, and gloo's connections are torn down at interpreter exit while a
        peer may still hold them (a CI run saw rank 1 of a finished torchrun run abort there, SIGABRT, after rank 0
        had written everything)."""
        dist.barrier()
        dist.destroy_process_group()

    def broadcast_tensors(self, tree: Any, src: int) -> Any:
        """A nested structure of dicts (and lists) with tensor leaves, from rank `src` to every rank, on each rank's
        device: its layout as one object, its tensors as one byte buffer (sent through the backend, or shared by
        CUDA IPC when all ranks are on one GPU). The other ranks get views of the buffer they received (a tensor
        kept after the others should be cloned, or it keeps the whole buffer alive), or through IPC their own
        copies; src keeps its tensors (at Flash width a copy of the reference's taps would be ~6 GB more on rank 0)."""
        leaves: list[torch.Tensor] = []
        layout = _layout(tree, leaves) if self.rank == src else None
        if self.one_gpu:
            return self._broadcast_by_ipc(layout, leaves, src)
        message = [layout]
        dist.broadcast_object_list(message, src)
        shapes = _leaf_shapes(message[0])
        buffer = _pack(leaves, self.device) if self.rank == src else \
            torch.empty(sum(_sizes(shapes)), dtype=torch.uint8, device=self.device)
        dist.broadcast(buffer, src)
        return _build(message[0], iter(leaves if self.rank == src else _unpack(buffer, shapes, copy=False)))

    def _broadcast_by_ipc(self, layout: Any, leaves: list[torch.Tensor], src: int) -> Any:
        """broadcast_tensors on one GPU: src's byte buffer is mapped into the other ranks, which copy their tensors
        out of it. src holds the buffer until every rank has copied: torch counts one IPC reference per share, so
        with two or more receivers the first to let go would otherwise free it under the others."""
        buffer = _pack(leaves, self.device) if self.rank == src else None
        message = [layout, reduce_tensor(buffer) if buffer is not None else None]
        dist.broadcast_object_list(message, src)
        layout, (rebuild, args) = message
        # rebuild maps src's buffer (waiting for src's writes); the mapping is dropped once the copies are made
        restored = leaves if self.rank == src else _unpack(rebuild(*args), _leaf_shapes(layout), copy=True)
        torch.cuda.synchronize(self.device)
        dist.barrier()
        buffer = None
        torch.cuda.ipc_collect()  # src: free it now that no rank maps it (else it waits in IPC limbo)
        return _build(layout, iter(restored))

    def all_gather_objects(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


def _layout(tree: Any, leaves: list[torch.Tensor]) -> Any:
    """The structure with each tensor replaced by ('tensor', shape, dtype), the tensors appended to `leaves`."""
    if isinstance(tree, torch.Tensor):
        leaves.append(tree)
        return ("tensor", tuple(tree.shape), tree.dtype)
    if isinstance(tree, dict):
        return {k: _layout(v, leaves) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_layout(v, leaves) for v in tree]
    return tree


def _leaf_shapes(layout: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
    if isinstance(layout, tuple) and layout and layout[0] == "tensor":
        return [(layout[1], layout[2])]
    if isinstance(layout, dict):
        return [s for v in layout.values() for s in _leaf_shapes(v)]
    if isinstance(layout, list):
        return [s for v in layout for s in _leaf_shapes(v)]
    return []


def _build(layout: Any, tensors: Any) -> Any:
    if isinstance(layout, tuple) and layout and layout[0] == "tensor":
        return next(tensors)
    if isinstance(layout, dict):
        return {k: _build(v, tensors) for k, v in layout.items()}
    if isinstance(layout, list):
        return [_build(v, tensors) for v in layout]
    return layout


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty(0, dtype=dtype).element_size()


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _sizes(shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> list[int]:
    return [_padded(_nbytes(shape, dtype)) for shape, dtype in shapes]


def _pack(leaves: list[torch.Tensor], device: str) -> torch.Tensor:
    """The leaves' bytes in one buffer, each starting at a multiple of ALIGN: one copy of each leaf into its slice (a
    cat of padded leaves copied the padded ones twice: the demo's reference rank spent 1.9 s packing its taps). The
    padding bytes are never read."""
    sizes = _sizes([(tuple(t.shape), t.dtype) for t in leaves])
    buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    offset = 0
    for t, size in zip(leaves, sizes):
        _typed(buffer[offset:], tuple(t.shape), t.dtype).copy_(t.detach())
        offset += size
    return buffer


def _unpack(buffer: torch.Tensor, shapes: list[tuple[tuple[int, ...], torch.dtype]], copy: bool
            ) -> list[torch.Tensor]:
    """The tensors _pack put in `buffer`: views of it (a buffer this rank received into and keeps no other use for),
    or with `copy`, copies (a buffer mapped from another rank, which it frees)."""
    parts = [_typed(part, shape, dtype) for part, (shape, dtype) in zip(buffer.split(_sizes(shapes)), shapes)]
    return [p.clone() for p in parts] if copy else parts


def _typed(raw: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The first bytes of a uint8 buffer slice viewed as a tensor of `shape` and `dtype` (the slice starts at a
    multiple of ALIGN, so any dtype's view is aligned)."""
    return raw[: _nbytes(shape, dtype)].view(dtype).reshape(shape)


class ShardedRunner(LockstepRunner):
    """The lockstep runner as one rank of a sharded run (the module docstring says who does what)."""

    def __init__(self, spec: RunSpec, store: RunStore, group: Group, progress: Callable | None = None) -> None:
        super().__init__(spec, store, progress if group.rank == 0 else None)
        self.group = group
        self.ranks_per_device = group.ranks_per_device
        self._ahead: dict[int, ReferencePass | Exception] = {}
        """The reference rank's passes over the next layers, run ahead (or the error one raised), by layer."""
        self.waited = {"reference_s": 0.0, "rows_s": 0.0}
        """Seconds this rank spent in the layers' collectives: receiving (or sending) the reference's pass, and
        gathering the rows — nearly all of it waiting for the slowest rank (the bytes are a small part)."""
        self.rank_waits: list[dict[str, float]] = []
        """On rank 0: every rank's `waited` as of the last gather (the run's segment records them)."""

    HOST_LANES = False
    """A rank runs its pairs one after another (no harness.run.host_lanes): ranks sharing one GPU already overlap
    one another's host time, and two lanes per rank, beside the collectives, have not been run on a GPU."""

    def own_stacks(self) -> list[tuple[str, str]]:
        return self.spec.stacks_of_rank(self.group.rank, self.group.world)

    @property
    def reference_rank(self) -> int:
        """The rank that runs the reference: the last, whose share of the pairs the deal (harness.run.deal) makes
        lighter by the reference's cost, so it has the time to run a later layer's reference while the others
        finish this layer's stacks."""
        return self.group.world - 1

    @property
    def reference_lead(self) -> int:
        """How many layers ahead of the others this run's reference rank runs the reference (reference_lead())."""
        return reference_lead(self.device)

    def _reference_pass(self, layer: int, ref_in: torch.Tensor, weights: TensorBundle | None) -> ReferencePass:
        """The reference rank runs the reference (or has run it ahead, _between_layers); every rank receives its
        output and its recorded taps."""
        src = self.reference_rank
        self._enter(layer, "reference", "global")
        ahead = self._ahead.pop(layer, None)
        if isinstance(ahead, BaseException):  # this layer's reference failed, run ahead while earlier rows were due
            raise ahead
        if ahead is not None:
            ref = ahead
        else:
            ref = self._prepare_layer(layer, weights)
            if self.group.rank == src:
                self._run_reference(ref, ref_in)
        tree = {"out": ref.out, "dense": ref.record.dense, "rows": ref.record.rows, "samples": ref.record.samples} \
            if self.group.rank == src else None
        t0 = time.perf_counter()
        tree = self.group.broadcast_tensors(tree, src=src)
        self.waited["reference_s"] += time.perf_counter() - t0
        if self.group.rank != src:
            ref.record.dense.update(tree["dense"])
            ref.record.rows.update(tree["rows"])
            for tap, entries in tree["samples"].items():
                ref.record.samples.setdefault(tap, {}).update(entries)
            # received as a view of the taps' one buffer (broadcast_tensors): the stream outlives the layer as the next
            # one's input, and would keep every tap of this layer alive with it
            ref.out = tree["out"] if self.group.one_gpu else tree["out"].clone()
        return ref

    def _between_layers(self, layer: int, inputs: dict[str, torch.Tensor], ref_out: torch.Tensor) -> None:
        """On the reference rank, once its stacks of `layer` are done: the references of the next layers, up to
        reference_lead ahead, while the other ranks still run theirs (the gather of this layer's rows waits for
        everyone). The layer's input streams are dropped first (run() replaces them with the layer's output), so the
        rank holds one set of streams beside the reference's working set, as when it runs the reference at the start
        of a layer. A failure is raised when its layer starts, so the layers before it are written first; its frames
        (that layer's weights and taps) are cleared so that the gathers and the resume state do not run short of
        memory on their account, and no later layer is run ahead past it (it would need the failed layer's output)."""
        if self.group.rank != self.reference_rank:
            return
        inputs.clear()
        where = dict(self.where)  # the run-ahead names its own layers while it runs (an interrupt there says so)
        self._run_ahead(layer, ref_out)
        self.where = where  # this layer's gather and state are next: a failure there is this layer's

    def _run_ahead(self, layer: int, ref_out: torch.Tensor) -> None:
        """The references of layers layer + 1 … layer + reference_lead not held yet (_between_layers)."""
        for ahead_layer in range(layer + 1, min(layer + 1 + self.reference_lead, self.weights.until)):
            held = self._ahead.get(ahead_layer)
            if isinstance(held, BaseException):
                return
            if held is not None:
                ref_out = held.out
                continue
            try:
                ref = self._prepare_layer(ahead_layer)
                self._run_reference(ref, ref_out)
            except Exception as e:  # noqa: BLE001 — raised again by _reference_pass at ahead_layer
                ref = None
                traceback.clear_frames(e.__traceback__)
                self._ahead[ahead_layer] = e
                return
            self._ahead[ahead_layer] = ref
            ref_out = ref.out

    def _write_layer(self, layer: int, rows: dict[tuple[str, str], list[dict]], dumped: dict[str, torch.Tensor]
                     ) -> None:
        """Rows and dumps gathered to rank 0, which writes them; this layer's findings reach every rank, in stack
        order (a one-process run finds them in that order)."""
        mine = [f for f in self.findings if f.layer == layer]
        t0 = time.perf_counter()
        gathered = self.group.all_gather_objects(
            (rows, [f.to_dict() for f in mine], {k: v.cpu() for k, v in dumped.items()} if self.group.rank else {},
             dict(self.waited)))  # this rank's waits before this gather: the figures leave out the last gather's
        self.waited["rows_s"] += time.perf_counter() - t0
        self.rank_waits = [{k: round(v, 2) for k, v in waits.items()} for *_, waits in gathered]
        order = {pair: i for i, pair in enumerate(self.spec.stacks())}
        found = [Finding(**f) for _, fs, _, _ in gathered for f in fs]
        found.sort(key=lambda f: order.get((f.variant, f.mode), len(order)))
        self.findings[:] = [f for f in self.findings if f.layer != layer] + found
        if self.group.rank == 0:
            all_rows = {k: v for r, _, _, _ in gathered for k, v in r.items()}
            all_dumped = {**dumped, **{k: v for _, _, d, _ in gathered for k, v in d.items()}}
            super()._write_layer(layer, all_rows, all_dumped)

    def _save_state(self, layer: int, streams: dict[str, torch.Tensor], last_save: float) -> float:
        """Rank 0 decides whether the state is due; if so every rank sends it the global streams it holds."""
        due = [self.group.rank == 0 and self._should_save_streams(streams, layer, last_save)]
        dist.broadcast_object_list(due, src=0)
        if not due[0]:
            return last_save
        gathered = dict(streams)
        for src in range(1, self.group.world):
            mine = {k: v for k, v in streams.items() if k != "reference"} if self.group.rank == src else None
            received = self.group.broadcast_tensors(mine, src)
            if self.group.rank == 0:
                gathered.update(received)
        if self.group.rank != 0:
            return last_save
        self.store.save_streams(layer, gathered, background=True)
        return time.perf_counter()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference_lead(device: torch.device | str) -> int:
    """How many layers ahead of the others a sharded run's reference rank runs the reference
    (ShardedRunner._between_layers); the memory estimate reads it too. CSA and HCA layers alternate (spec §1.2), and a
    CSA layer's reference costs ~3× an HCA layer's (the demo on the CPU: 0.71 against 0.24 s), so one layer ahead
    pairs each layer's stacks with a reference of the other kind: the reference rank idled ~0.55 s at every CSA layer
    and the others ~0.43 s at every HCA layer. Two ahead pairs like with like. On a CPU: the rank then holds one more
    layer's weights, dequantized copies, taps and output stream (the memory estimate's "reference run ahead" term: 76
    MiB for the demo). On a GPU one: that layer at Flash width is tens of GiB of a device the ranks share, and the
    gain there has not been measured."""
    return 2 if torch.device(device).type == "cpu" else 1


def rank_device(device: str, rank: int) -> tuple[str, int]:
    """The device rank `rank` runs on, and how many ranks share it: CUDA ranks spread over the visible GPUs
    (cuda:rank mod count; two ranks share one GPU when there is one); CPU ranks share the CPU."""
    if not device.startswith("cuda"):
        return "cpu", 0
    count = torch.cuda.device_count()
    return f"cuda:{rank % count}", count


def ranks_per_device(device: str, world: int) -> int:
    """How many of `world` ranks share one device, as rank_device spreads them: ceil(world / GPUs) on CUDA, 1 on the
    CPU (its ranks share the host, not a device). Their dequantized-weight caches and the memory check split it."""
    count = rank_device(device, 0)[1]
    return -(-world // count) if count else 1


MPS_DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
"""Where the NVIDIA MPS control daemon puts its pipes unless CUDA_MPS_PIPE_DIRECTORY says otherwise (the CUDA MPS
documentation); a CUDA process looks there when it starts and, when the daemon runs, becomes its client."""


def mps_control_pipe(environ: dict[str, str] | None = None) -> Path:
    """The MPS control daemon's pipe that this process's CUDA context would connect through."""
    env = os.environ if environ is None else environ
    return Path(env.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_DEFAULT_PIPE_DIRECTORY) / "control"


def shared_gpu_note(device: str, world: int, environ: dict[str, str] | None = None) -> str | None:
    """A note when ranks share a GPU, saying whether NVIDIA MPS lets their kernels run together, and what sharing
    was measured to give.

    A run at Flash width is host-bound (README, Benchmarks: the GPU busy about half of a layer), so ranks on one GPU
    could overlap one's host work with another's kernels — but without MPS the GPU time-slices between processes.
    Measured on one H200: `flash-30k --patches none` (2026-12-02, layers 2–8): one process 76.3 and 80.1 s, two
    ranks 69.4 s (1.13×), two ranks under MPS 58.7 and 59.0 s (1.33×); `flash-30k --patches all` (2026-12-05, one
    process running its stacks in two host threads, layers 4–12): one process 96.3 s, two ranks under MPS 121.1 s
    (0.80×). Whether sharing pays depends on the run: the note says so rather than promise a gain."""
    per = ranks_per_device(device, world)
    if per < 2:
        return None
    measured = ("measured on one H200 at flash-30k: 1.33× for --patches none, 0.80× for --patches all; time a few "
                "layers against --devices 1 before a long run")
    pipe = mps_control_pipe(environ)
    if pipe.exists():
        return f"{per} ranks share each GPU through NVIDIA MPS ({pipe}): their kernels run side by side ({measured})"
    return (f"{per} ranks share each GPU, and no NVIDIA MPS daemon was found ({pipe}): the GPU time-slices the "
            f"processes. Start `nvidia-cuda-mps-control -d` first ({measured}; README: Several GPUs or processes)")


def join_group(rank: int, world: int, device: str) -> Group:
    """Initialise torch.distributed for this rank (MASTER_ADDR/MASTER_PORT in the environment): NCCL when each rank
    has a GPU of its own, gloo on the CPU and when ranks share a GPU (NCCL refuses two ranks on one device:
    "Duplicate GPU detected", seen on an H200)."""
    own = rank_device(device, rank)[0]
    sharing = ranks_per_device(device, world)
    if own.startswith("cuda"):
        torch.cuda.set_device(own)
    nccl = own.startswith("cuda") and sharing == 1
    dist.init_process_group("nccl" if nccl else "gloo", rank=rank, world_size=world,
                            device_id=torch.device(own) if nccl else None)
    return Group(rank, world, own, sharing)


def from_environment(device: str) -> Group | None:
    """The group torchrun describes (WORLD_SIZE > 1, RANK), joined; None outside torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    return join_group(int(os.environ["RANK"]), world, device)


class RankFailed(RuntimeError):
    """A rank of a sharded run stopped with an error (the message names it, ending with the rank's
    `ExceptionType: message` line, as torch.multiprocessing reports it)."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank
        raised = _raised_type(message)
        builtin = getattr(builtins, raised, None)
        self.plugin_fault = "PluginOpError" in message  # a patch's op raised on that rank (exit code 3)
        # a file the run reads or writes, or an input it checks, failed on that rank: the user's to fix (exit code 2),
        # as the same error in one process would be
        self.input_fault = not self.plugin_fault and (
            raised == "UsageError" or (isinstance(builtin, type) and issubclass(builtin, OSError)))


def _raised_type(message: str) -> str:
    """The unqualified exception type of a rank's report's last line (`harness.errors.UsageError: …` -> UsageError;
    '' when the line names none)."""
    head = message.strip().splitlines()[-1].split(" failed: ")[-1].split(":", 1)[0].strip()
    return head.rsplit(".", 1)[-1] if re.fullmatch(r"[\w.]+", head) else ""


def launch(world: int, worker: Callable[..., None], *args: Any) -> None:
    """Run worker(rank, world, *args) in `world` local processes joined as one group; when a rank fails, the others
    are ended and RankFailed names it."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    try:
        mp.start_processes(_entry, args=(world, worker, args), nprocs=world, join=True, start_method="spawn")
    except mp.ProcessRaisedException as e:
        raise RankFailed(e.error_index, f"rank {e.error_index} of {world} failed: "
                                        f"{str(e).strip().splitlines()[-1]}") from None
    except mp.ProcessExitedException as e:
        raise RankFailed(e.error_index, f"rank {e.error_index} of {world} died (exit code {e.exit_code}"
                                        f"{', signal ' + e.signal_name if e.signal_name else ''})") from None


def _entry(rank: int, world: int, worker: Callable[..., None], args: tuple) -> None:
    try:
        with torch.inference_mode():  # as harness.cli.main.run_command runs every command: a rank is part of one
            worker(rank, world, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class ReadOnlyStore(RunStore):
    """A rank's view of the run directory beside rank 0: it reads (the manifest, findings and resume state a
    resumed run starts from) and writes nothing, as rank 0 writes everything — except, when it stops on an error,
    where it stopped (`failure_path`), which the launching process puts into the manifest (run_sharded)."""

    def __init__(self, run_dir: str | Path, rank: int) -> None:
        super().__init__(run_dir)
        self.rank = rank

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        pass

    def update_manifest(self, **fields: Any) -> dict[str, Any]:
        """Only a failure is kept (LockstepRunner._record_stop: the layer, stack and mode, and the error)."""
        if fields.get("failure"):
            failure_path(self.dir, self.rank).write_text(json.dumps(fields["failure"]))
        return self.read_manifest()

    def write_layer(self, layer: int, rows: list[dict[str, Any]], background: bool = False) -> None:
        pass

    def write_findings(self, findings: list[dict[str, Any]]) -> None:
        pass

    def save_streams(self, layer: int, streams: dict[str, torch.Tensor], background: bool = False) -> None:
        pass

    def write_dump(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        pass


@dataclass(frozen=True)
class RunRecipe:
    """What each rank needs to rebuild the run itself (patches, plugins and weight sources do not travel between
    processes): the run directory, whose manifest holds the scenario, overrides and decode ids; the variants (patch
    ids and options), local mode, device, threads and the layer to start at."""

    run_dir: str
    device: str
    threads: int
    variants: tuple[tuple[str, tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]], ...]
    local: bool
    start_layer: int = 0
    segment_started: float | None = None
    """time.time() when the launcher opened this segment in the manifest's `segments` (None: no segment to keep
    current, e.g. under torchrun): rank 0 records its time and last layer there after every layer."""

    @classmethod
    def of(cls, spec: RunSpec, run_dir: Path, threads: int, start_layer: int = 0,
           segment_started: float | None = None) -> "RunRecipe":
        variants = tuple((v.name, tuple((c.id, tuple(sorted(c.options.items()))) for c in v.choices))
                         for v in spec.variants)
        return cls(str(run_dir), spec.device, threads, variants, spec.local, start_layer, segment_started)

    def spec(self, manifest: dict[str, Any], device: str) -> RunSpec:
        spec = spec_from_manifest(manifest, device)
        registry = load_registry(list(scenario_from_manifest(manifest).stacks.patch_modules)  # as build_run_spec
                                 + list(manifest["overrides"]["patch_modules"]))
        spec.variants = [VariantSpec(name, registry.choose([pid for pid, _ in patches],
                                                           {pid: dict(opts) for pid, opts in patches}))
                         for name, patches in self.variants]
        spec.local = self.local
        return spec


def run_rank(rank: int, world: int, recipe: RunRecipe) -> None:
    """One rank of a sharded run started by `launch`: join the group, then run its share."""
    keep_freed_host_memory()  # a spawned rank is a fresh process: as run_command does in the parent
    torch.set_num_threads(recipe.threads)
    torch.set_float32_matmul_precision("highest")
    run_share(join_group(rank, world, recipe.device), recipe)


def run_share(group: Group, recipe: RunRecipe) -> None:
    """This rank's share of the run: rebuild it from the run directory and run it (rank 0 prints a line a layer)."""
    rank, world = group.rank, group.world
    store = RunStore(recipe.run_dir) if rank == 0 else ReadOnlyStore(recipe.run_dir, rank)
    spec = recipe.spec(store.read_manifest(), group.device)
    streams = store.load_streams()[1] if recipe.start_layer > 0 else None
    log = LayerLog(f", {world} ranks")
    done: list[int] = []

    def progress(event: dict[str, Any]) -> None:
        if event["event"] == "layer_done":
            print(log.line(event), flush=True)
            done.append(event["layer"])
            if rank == 0 and recipe.segment_started is not None:
                record_layer_in_segment(store, recipe.segment_started, event["layer"], runner.rank_waits)

    runner = ShardedRunner(spec, store, group, progress)
    runner.run(recipe.start_layer, streams)
    if rank == 0 and recipe.segment_started is not None and done:  # the waits up to the final logits' gather
        record_layer_in_segment(store, recipe.segment_started, done[-1], runner.rank_waits)


def record_layer_in_segment(store: RunStore, started: float, layer: int,
                            rank_waits: list[dict[str, float]] | None = None) -> None:
    """After a layer, the open segment (the manifest's last) gets its seconds so far and the layer: a run killed
    mid-way still says what it cost, as the one-process run's segments do; and, given, each rank's seconds in the
    layers' collectives (`rank_wait_s`: a rank that waits much carries less than its share)."""
    segments = store.read_manifest().get("segments", [])
    if segments:
        segments[-1].update(seconds=round(time.time() - started, 2), last_layer=layer)
        if rank_waits:
            segments[-1]["rank_wait_s"] = rank_waits
        store.update_manifest(segments=segments)


def run_sharded(world: int, spec: RunSpec, store: RunStore, threads: int, start_layer: int = 0,
                segment_started: float | None = None) -> None:
    """The run in `world` local processes. A rank that fails fails the run: the manifest says `failed`, names the
    rank, and keeps the layers rank 0 wrote (`run --resume` continues from its last saved state). With
    `segment_started`, rank 0 keeps the manifest's last segment current after every layer."""
    try:
        launch(world, run_rank, RunRecipe.of(spec, store.dir, threads, start_layer, segment_started))
    except RankFailed as e:
        try:  # rank 0, ended by the launcher, may have left metrics.parquet a layer behind the parts it wrote
            store.combine()
        except Exception:  # noqa: BLE001 — the rank's failure is the error to report
            pass
        first = first_reported_failure(store.dir, world, before_ns=store.manifest_path.stat().st_mtime_ns) \
            if e.rank == 0 and not (e.plugin_fault or e.input_fault) else None
        if first is not None:  # rank 0's collective broke because another rank had stopped first and said where
            rank, where = first
            message = f"rank {rank} of {world} failed: {where.get('error', 'no error recorded')}"
            record_rank_failure(store, world, rank, where, message)
            raise RankFailed(rank, message) from None
        reported = failure_path(store.dir, e.rank)
        where = json.loads(reported.read_text()) if reported.is_file() else None
        # rank 0 was ended before it could say so itself, or said only that the failed rank's connection broke
        record_rank_failure(store, world, e.rank, where, str(e),
                            overwrite=where is not None or store.read_manifest().get("status") == "running")
        raise


def failure_path(run_dir: str | Path, rank: int) -> Path:
    """Where rank `rank` (> 0) of a sharded run says where it stopped on an error."""
    return Path(run_dir) / f"failure-rank-{rank}.json"


def first_reported_failure(run_dir: str | Path, world: int, before_ns: int | None = None
                           ) -> tuple[int, dict[str, Any]] | None:
    """The rank > 0 whose failure report was written first, and the report: when one rank stops, the others'
    collectives break and they report too, later, that it went away. `before_ns`: only reports written before then
    (rank 0 records its own stop in the manifest as it stops: a report written after it is the consequence of rank
    0's failure, not its cause; which failing process torch.multiprocessing names first is a race)."""
    reports = []
    for rank in range(1, world):
        path = failure_path(run_dir, rank)
        if path.is_file() and (before_ns is None or path.stat().st_mtime_ns <= before_ns):
            reports.append((path.stat().st_mtime_ns, rank, path))
    if not reports:
        return None
    _, rank, path = min(reports)
    return rank, json.loads(path.read_text())


def record_rank_failure(store: RunStore, world: int, rank: int, where: dict[str, Any] | None, error: str,
                        overwrite: bool = True) -> None:
    """The manifest's failure names the rank that stopped, with where it stopped (its report: layer, stack, mode)
    and its error; the ranks' reports are removed once merged."""
    for stale in range(1, world):
        failure_path(store.dir, stale).unlink(missing_ok=True)
    if overwrite:
        store.update_manifest(status="failed", failure={
            "rank": rank, **{k: where[k] for k in ("layer", "stack", "mode") if k in (where or {})},
            "error": error, "state_layer": store.read_manifest().get("state_layer")})
