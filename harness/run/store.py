"""The run directory: what a run measured, written so that a killed run loses nothing it finished.

    RUN_DIR/
      manifest.json          scenario, resolved config, seeds, patches, versions, device, times, progress
      metrics.parquet        long format, one row per (variant, mode, layer, bin, tap, metric)
      parts/layer-NNN.parquet  the same rows per layer (metrics.parquet is their concatenation)
      findings.json          first NaN/Inf per stack (layer, tap, phase, position)
      state/streams.pt       every stack's streams after the last saved layer (for --resume; deleted when the
                             run completes, unless `run --keep-state`)
      dumps/*.safetensors    raw tensors asked for by the scenario's probes.dump

Every file is written to a temporary name and renamed, so a crash leaves either the old or the new file.
"""

from __future__ import annotations

import json
import os
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from harness.errors import UsageError

METRICS_SCHEMA = pa.schema([
    ("variant", pa.string()), ("mode", pa.string()), ("layer", pa.int32()), ("phase", pa.string()),
    ("chunk", pa.int32()), ("step", pa.int32()), ("turn", pa.int32()), ("pos_bin", pa.int64()),
    ("pos_end", pa.int64()), ("tap", pa.string()), ("metric", pa.string()), ("value", pa.float64()),
    ("max", pa.float64()), ("count", pa.int64()),
])
"""Columns of metrics.parquet: value = the bin's aggregate (mean, or the ratio of summed terms for
rel_l2/sqnr), max = the largest per-position value in the bin, count = positions in the bin."""


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class RunStore:
    def __init__(self, run_dir: str | Path) -> None:
        self.dir = Path(run_dir)
        self.manifest_path = self.dir / "manifest.json"
        self.metrics_path = self.dir / "metrics.parquet"
        self.parts_dir = self.dir / "parts"
        self.findings_path = self.dir / "findings.json"
        self.state_path = self.dir / "state" / "streams.pt"
        self.dumps_dir = self.dir / "dumps"
        self._parts: dict[Path, pa.Table] = {}  # layer parts read or written by this store, so each is read once
        self._combine_lock = threading.Lock()  # _parts and the combiner's state, shared with its thread
        self._combiner: threading.Thread | None = None
        self._combine_wanted = False
        self._combine_error: BaseException | None = None
        self._manifest_lock = threading.Lock()  # the resume state's writer thread updates the manifest too
        self._state_writer: threading.Thread | None = None
        self._state_error: BaseException | None = None
        self._host_buffers: dict[str, torch.Tensor] = {}  # page-locked snapshots of device streams, reused
        self._lock_refused = False  # the host refused page-locked memory once: pageable copies from then on

    # --- manifest ---------------------------------------------------------------------------
    def exists(self) -> bool:
        return self.manifest_path.is_file()

    def create(self, manifest: dict[str, Any]) -> None:
        if self.exists():
            raise FileExistsError(f"{self.dir} already holds a run (use --resume to continue it, or another --out)")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.parts_dir.mkdir(exist_ok=True)
        self.write_manifest(manifest)

    def read_manifest(self) -> dict[str, Any]:
        try:
            return json.loads(self.manifest_path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.dir} is not a run directory (no manifest.json)") from None
        except ValueError as e:
            raise UsageError(f"{self.manifest_path}: not valid JSON ({e}); the file is damaged") from None

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        _atomic_write_bytes(self.manifest_path, json.dumps(manifest, indent=2, sort_keys=False, default=str).encode())

    def update_manifest(self, **fields: Any) -> dict[str, Any]:
        with self._manifest_lock:
            manifest = self.read_manifest()
            manifest.update(fields)
            self.write_manifest(manifest)
            return manifest

    def new_segment(self, start_layer: int, device: str, **fields: Any) -> list[dict[str, Any]]:
        """The manifest's segments with one more, opened now (not written yet): a run or pass from `start_layer`,
        its seconds 0 until the caller records them; `fields` add what the caller knows (ranks)."""
        segments = self.read_manifest().get("segments", [])
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        segments.append({"start_layer": start_layer, "started": started, "seconds": 0.0, "device": device,
                         "threads": torch.get_num_threads(), **fields})
        return segments

    # --- metrics ----------------------------------------------------------------------------
    def part_path(self, layer: int) -> Path:
        return self.parts_dir / f"layer-{layer:03d}.parquet"

    def write_layer(self, layer: int, rows: list[dict[str, Any]], background: bool = False) -> None:
        """Write one layer's rows (atomically, before returning), then refresh metrics.parquet from all parts; with
        `background`, a thread refreshes it while the caller goes on (combine_soon). Rewriting the whole file is
        O(rows so far) per layer, O(layers²) in all: 1.6 s of the CPU demo's 72 s on its rank 0, against 0.07 s
        for one write of its 262,415 rows; a run's thread need not wait for it."""
        table = pa.Table.from_pylist(rows, schema=METRICS_SCHEMA)
        tmp = self.part_path(layer).with_suffix(".parquet.tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, self.part_path(layer))
        with self._combine_lock:
            self._parts[self.part_path(layer)] = table
        if background:
            self.combine_soon()
        else:
            self.flush_metrics()  # an earlier background combine must not replace this one's file after it
            self.combine()

    def completed_layers(self) -> list[int]:
        return sorted(int(p.stem.split("-")[1]) for p in self.parts_dir.glob("layer-*.parquet"))

    def combine_soon(self) -> None:
        """Refresh metrics.parquet from every part in a thread of its own, so the run goes on: requests made while
        one combine runs are served by one more (the file always ends with every part written before the last
        request). Raises the error an earlier combine stopped with. The thread is not a daemon, so a process that
        exits (an error, Ctrl-C) finishes the file first; a killed one leaves it at most the layers being combined
        behind the parts, which a resume or `combine()` catch up."""
        with self._combine_lock:
            self._combine_wanted = True  # before raising: a failed combine's request stays for flush_metrics
            self._raise_combine_error()
            if self._combiner is not None:
                return
            self._combiner = threading.Thread(target=self._combine_while_wanted, name="dsv4-drift-metrics")
            self._combiner.start()

    def flush_metrics(self) -> None:
        """Return once metrics.parquet holds every part this store has written; raise a combine's error. A request
        that a failed combine left unserved is served here, in this thread (a stop's flush catches the file up
        with the parts when the failure was passing; the error is raised all the same)."""
        combiner = self._combiner
        if combiner is not None:
            combiner.join()
        with self._combine_lock:
            error, self._combine_error = self._combine_error, None
            unserved, self._combine_wanted = self._combine_wanted, False
        if unserved:
            try:
                self.combine()
            except Exception as e:  # noqa: BLE001 — the first error is the one to report
                error = error or e
        if error is not None:
            raise error

    def _combine_while_wanted(self) -> None:
        while True:
            with self._combine_lock:
                if not self._combine_wanted or self._combine_error is not None:
                    self._combiner = None
                    return
                self._combine_wanted = False
            try:
                self.combine()
            except BaseException as e:  # noqa: BLE001 — raised in the run's thread by the next request or flush
                with self._combine_lock:
                    self._combine_error, self._combine_wanted = e, True  # unserved: flush_metrics tries again

    def _raise_combine_error(self) -> None:
        error, self._combine_error = self._combine_error, None
        if error is not None:
            raise error

    def combine(self) -> None:
        """Write metrics.parquet as the concatenation of every part on disk (in this thread)."""
        parts = sorted(self.parts_dir.glob("layer-*.parquet"))
        with self._combine_lock:
            known = dict(self._parts)
        for p in parts:
            if p not in known:
                known[p] = pq.read_table(p, schema=METRICS_SCHEMA)
                with self._combine_lock:
                    self._parts.setdefault(p, known[p])
        table = pa.concat_tables([known[p] for p in parts]) if parts else METRICS_SCHEMA.empty_table()
        tmp = self.metrics_path.with_suffix(".parquet.tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, self.metrics_path)

    def read_metrics(self) -> pa.Table:
        self.flush_metrics()
        if not self.metrics_path.is_file():
            raise FileNotFoundError(f"{self.dir}: no metrics.parquet (the run has not finished a layer)")
        try:
            return pq.read_table(self.metrics_path)
        except pa.ArrowException as e:  # ArrowInvalid for a truncated file: the message names what is wrong
            raise UsageError(f"{self.metrics_path}: not a readable parquet file, truncated or damaged ({e})") from None

    # --- findings, resume state, dumps -------------------------------------------------------------
    def write_findings(self, findings: list[dict[str, Any]]) -> None:
        _atomic_write_bytes(self.findings_path, json.dumps(findings, indent=2).encode())

    def read_findings(self) -> list[dict[str, Any]]:
        if not self.findings_path.is_file():
            return []
        try:
            return json.loads(self.findings_path.read_text())
        except ValueError as e:
            raise UsageError(f"{self.findings_path}: not valid JSON ({e}); the file is damaged") from None

    def save_streams(self, layer: int, streams: dict[str, torch.Tensor], background: bool = False) -> None:
        """Save the streams a resume starts from, after `layer`. With `background`, a host copy is taken now and
        written by a thread while the run goes on (Flash at 30K tokens: ~5 GB, 14–17 s to write, once a minute —
        a quarter of the run's time when written in line); the next save, wait_for_state() and delete_state() wait
        for it. The file is replaced atomically and holds its own layer, so a run killed mid-write resumes from the
        state before."""
        self.wait_for_state()  # the previous snapshot's buffers are free again once it is written
        snapshot = {k: self._host_copy(k, v) for k, v in streams.items()}  # the stacks go on with theirs
        for name in set(self._host_buffers) - set(streams):  # a stream no longer saved keeps no buffer
            del self._host_buffers[name]
        if not background:
            self._write_state(layer, snapshot)
            return
        self._state_writer = threading.Thread(target=self._write_state_noting_error, args=(layer, snapshot),
                                              name="dsv4-drift-resume-state")
        self._state_writer.start()

    def _host_copy(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A host copy of one stream. From a GPU, into a page-locked buffer kept for the next save (the previous
        write has finished: save_streams waits for it): measured on an H200 host, 5 GB of streams (Flash at 30K
        tokens) took 3.6–4.4 s into fresh pageable memory — the run's thread waiting, once a minute, ~4 s of every
        save layer (flash-30k: 17.1 against 13.9 s per CSA layer) — and 0.09 s into kept page-locked buffers. A
        host that cannot lock that much memory gets the pageable copy, as before. Buffers dropped (delete_state, a
        stream no longer saved) go back to torch's page-locked host cache, which keeps them locked for the process's
        life (rounded up to a power of two): a run locks at most ~2× its streams' size."""
        value = value.detach()
        if not value.is_cuda and value.is_pinned():  # a stream placed on the host (harness.run.stream_placement):
            return value  # never written again, so the snapshot may hold it instead of a copy (15 GB for Flash's 15)
        if not value.is_cuda:
            return value.to("cpu", copy=True)
        buffer = self._host_buffers.get(name)
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            self._host_buffers.pop(name, None)
            if self._lock_refused:
                return value.to("cpu", copy=True)
            try:
                buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            except RuntimeError:  # page-locked memory refused: the ordinary copy, now and at later saves
                self._lock_refused = True
                return value.to("cpu", copy=True)
            self._host_buffers[name] = buffer
        return buffer.copy_(value)  # a device-to-host copy returns once the bytes are on the host

    def _write_state(self, layer: int, snapshot: dict[str, torch.Tensor]) -> None:
        self.state_path.parent.mkdir(exist_ok=True)
        tmp = self.state_path.with_suffix(".pt.tmp")
        torch.save({"layer": layer, "streams": snapshot}, tmp)
        os.replace(tmp, self.state_path)
        self.update_manifest(state_layer=layer)  # where a resume starts, readable without loading the streams

    def _write_state_noting_error(self, layer: int, snapshot: dict[str, torch.Tensor]) -> None:
        """The writer thread: its error is raised by the next wait_for_state(), in the run's thread."""
        try:
            self._write_state(layer, snapshot)
        except BaseException as e:  # noqa: BLE001
            self._state_error = e

    def wait_for_state(self) -> None:
        """Return once no resume state is being written; raise the error a background write stopped with."""
        if self._state_writer is not None:
            self._state_writer.join()  # cleared only once joined: an interrupted join leaves it for the next wait
            self._state_writer = None
        error, self._state_error = self._state_error, None
        if error is not None:
            raise error

    def delete_state(self) -> None:
        """Remove the resume state (a finished run needs none; the demo's is 20 MB, Flash at 27K 3.5 GB)."""
        try:
            self.wait_for_state()
        except Exception:  # noqa: BLE001 — a write that failed (OSError, torch's RuntimeError) leaves its .tmp
            pass
        self._host_buffers.clear()
        self.state_path.with_suffix(".pt.tmp").unlink(missing_ok=True)
        self.state_path.unlink(missing_ok=True)
        if self.state_path.parent.is_dir() and not any(self.state_path.parent.iterdir()):
            self.state_path.parent.rmdir()

    def load_streams(self) -> tuple[int, dict[str, torch.Tensor]]:
        saved = torch.load(self.state_path, weights_only=True)
        return int(saved["layer"]), saved["streams"]

    def write_dump(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        if not tensors:
            return
        self.dumps_dir.mkdir(exist_ok=True)
        save_file(tensors, str(self.dumps_dir / f"{name}.safetensors"))
