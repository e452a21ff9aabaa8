"""Trace: when each op of a plan ran (predicted by offsim.core.sim or measured by offexec), in one schema, and the
metrics both halves report.

Throughput follows FlexGen's definitions (docs/architecture.md §9), so numbers compare with the papers:
prefill tok/s = prompts · prompt_len / prefill_s; decode tok/s = prompts · (gen_len − 1) / decode_s;
total tok/s = prompts · gen_len / (prefill_s + decode_s). prefill_s ends when the last step-0 op ends; decode_s is the
rest of the makespan.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from offsim.core.errors import OffsimError
from offsim.core.io import read_commented_csv, write_commented_csv, write_text_atomic
from offsim.core.plan import ALL_STREAMS, SHARED_STREAMS, STREAMS, TIERS

TRACE_SCHEMA = "offsim.trace/1"
COLUMNS = ["op_id", "kind", "stream", "phase", "step", "layer", "batch", "start_s", "end_s", "nbytes"]
NUMERIC_COLUMNS = ["op_id", "step", "layer", "batch", "start_s", "end_s", "nbytes"]


@dataclass
class Trace:
    """One row per op. ``meta`` says what ran where: model, hardware, policy, workload (dict), source
    ('offsim' or 'offexec'), and for measured traces machine/commit/date. ``peak_bytes`` per tier."""

    df: pd.DataFrame
    meta: dict = field(default_factory=dict)
    peak_bytes: dict = field(default_factory=lambda: {t: 0 for t in TIERS})

    # ---- metrics ----------------------------------------------------------------------------------------------
    @property
    def makespan_s(self) -> float:
        return float(self.df["end_s"].max()) if len(self.df) else 0.0

    def metrics(self) -> dict:
        """Phase times and throughputs (FlexGen's definitions), per-stream busy time, GPU idle, peak bytes."""
        wl = self.meta["workload"]
        prompts = wl["gpu_batch_size"] * wl["num_gpu_batches"]
        df = self.df
        makespan = self.makespan_s
        pre_end = df["end_s"][df["step"].to_numpy() == 0]  # (the one column, not the prefill rows of every column)
        prefill_s = float(pre_end.max()) if len(pre_end) else 0.0
        decode_s = makespan - prefill_s
        dur = df["end_s"] - df["start_s"]
        # each stream's ops by numpy's compare of the column's strings: the string column's own compare takes ~5x as
        # long (~25 ms an OPT-175B plan, per stream); the same ops summed in the same order
        stream = df["stream"].to_numpy()
        busy = {s: float(dur[stream == s].sum()) for s in STREAMS}
        # several GPUs (a trace with a 'device' column): a GPU stream's busy time is the mean over the devices (so
        # that idle fractions stay per GPU); the host's shared streams are one each
        ndev = int(df["device"].max()) + 1 if "device" in df and len(df) else 1
        if ndev > 1:  # (over several nodes, the host streams are one per node: per-node means)
            nnodes = int(self.meta.get("num_nodes", 1))
            busy = {s: b / nnodes if s in SHARED_STREAMS else b / ndev for s, b in busy.items()}
            busy["p2p"] = float(dur[stream == "p2p"].sum()) / ndev
        out = {
            "model": self.meta.get("model"), "hardware": self.meta.get("hardware"),
            "policy": self.meta.get("policy"), "source": self.meta.get("source"),
            "prompt_len": wl["prompt_len"], "gen_len": wl["gen_len"],
            "gpu_batch_size": wl["gpu_batch_size"], "num_gpu_batches": wl["num_gpu_batches"], "batch": prompts,
            "prefill_s": prefill_s, "decode_s": decode_s, "total_s": makespan,
            "prefill_tok_s": prompts * wl["prompt_len"] / prefill_s if prefill_s > 0 else float("inf"),
            "decode_tok_s": prompts * (wl["gen_len"] - 1) / decode_s if decode_s > 0 else float("inf"),
            "total_tok_s": prompts * wl["gen_len"] / makespan if makespan > 0 else float("inf"),
            "gpu_idle_s": makespan - busy["compute"],
            "gpu_idle_frac": (makespan - busy["compute"]) / makespan if makespan > 0 else 0.0,
        }
        for s in STREAMS:
            out[f"busy_{s}_s"] = busy[s]
        for t in TIERS:
            out[f"peak_{t}_bytes"] = int(self.peak_bytes.get(t, 0))
        if ndev > 1:  # (peak_gpu_bytes is then the largest device's)
            out["num_devices"] = ndev
            out["busy_p2p_s"] = busy["p2p"]
            for d in range(ndev):
                out[f"peak_gpu{d}_bytes"] = int(self.peak_bytes.get(f"gpu{d}", 0))
            if nnodes > 1:  # (peak_cpu_bytes and peak_disk_bytes are then the largest node's)
                out["num_nodes"] = nnodes
                for n in range(nnodes):
                    for t in ("cpu", "disk"):
                        out[f"peak_{t}{n}_bytes"] = int(self.peak_bytes.get(f"{t}{n}", 0))
        return out

    def step_latency(self) -> pd.DataFrame:
        """Per generation step: start, end and latency (end of step minus end of the previous step)."""
        g = self.df.groupby("step").agg(start_s=("start_s", "min"), end_s=("end_s", "max")).reset_index()
        g["latency_s"] = g["end_s"].diff().fillna(g["end_s"])
        return g

    def busy_by(self, keys=("kind",)) -> pd.DataFrame:
        """Total op time grouped by ``keys`` (e.g. ('step', 'kind'))."""
        d = self.df.assign(dur_s=self.df["end_s"] - self.df["start_s"])
        return d.groupby(list(keys))["dur_s"].agg(["sum", "count", "mean"]).reset_index()

    # ---- export -----------------------------------------------------------------------------------------------
    def to_chrome(self, path: str | Path) -> None:
        """Chrome/Perfetto trace JSON: one track per stream (open in ui.perfetto.dev or chrome://tracing)."""
        # several GPUs: one process track per device (its streams as threads; the host's shared streams on GPU 0's)
        tid = {s: i for i, s in enumerate(ALL_STREAMS if "device" in self.df else STREAMS)}
        devices = sorted(set(self.df["device"])) if "device" in self.df else [0]
        events = [{"name": "thread_name", "ph": "M", "pid": int(d), "tid": i, "args": {"name": s}}
                  for d in devices for s, i in tid.items()]
        dev = self.df["device"].tolist() if "device" in self.df else [0] * len(self.df)
        for d, r in zip(dev, self.df.itertuples(index=False)):
            events.append({"name": f"{r.kind} L{r.layer} b{r.batch}", "cat": r.kind, "ph": "X", "pid": int(d),
                           "tid": tid[r.stream], "ts": r.start_s * 1e6, "dur": (r.end_s - r.start_s) * 1e6,
                           "args": {"op": int(r.op_id), "step": int(r.step), "bytes": int(r.nbytes)}})
        write_text_atomic(path, json.dumps({"traceEvents": events, "otherData": _jsonable(self.meta)}))

    def write(self, path: str | Path) -> None:
        """``to_csv`` for a name ending in .csv or .csv.gz (any case), else ``to_chrome`` (what ``--trace`` does)."""
        name = str(path).lower()
        (self.to_csv if name.endswith((".csv", ".csv.gz")) else self.to_chrome)(path)

    def to_csv(self, path: str | Path) -> None:
        """CSV of the rows, with the metadata as a JSON comment on the first line."""
        write_commented_csv(path, {"schema": TRACE_SCHEMA, "meta": _jsonable(self.meta),
                                   "peak_bytes": self.peak_bytes}, self.df)

    @classmethod
    def from_csv(cls, path: str | Path) -> "Trace":
        info, df = read_commented_csv(path, "trace")
        if info.get("schema") != TRACE_SCHEMA:
            raise OffsimError(f"trace {path}: field 'schema' is {info.get('schema')!r}; expected {TRACE_SCHEMA!r}")
        missing = [c for c in COLUMNS if c not in df.columns]
        if missing:
            raise OffsimError(f"trace {path}: missing columns {missing}")
        cols = COLUMNS + ["device"] if "device" in df.columns else COLUMNS  # (several GPUs: each op's device)
        if not len(df):
            raise OffsimError(f"trace {path}: no op rows")
        for c in NUMERIC_COLUMNS + ["device"] * ("device" in df.columns):
            ok = np.isfinite(pd.to_numeric(df[c], errors="coerce").to_numpy(dtype=float))
            if not ok.all():
                i = int(np.flatnonzero(~ok)[0])
                raise OffsimError(f"trace {path}: column {c!r} must hold finite numbers; op row {i + 1} has "
                                  f"{df[c].iloc[i]!r}")
        if (df["end_s"] < df["start_s"]).any():
            i = int(np.flatnonzero((df["end_s"] < df["start_s"]).to_numpy())[0])
            raise OffsimError(f"trace {path}: op row {i + 1} ends before it starts ({df['start_s'].iloc[i]} > "
                              f"{df['end_s'].iloc[i]})")
        return cls(df=df[cols], meta=info.get("meta", {}), peak_bytes=info.get("peak_bytes", {}))

    @classmethod
    def from_arrays(cls, plan, start: np.ndarray, end: np.ndarray, meta: dict, peak_bytes: dict) -> "Trace":
        """Build from per-op start/end arrays indexed by op id (what the simulator and the executor record)."""
        ops = plan.ops
        cols = list(zip(*[(o.kind, o.stream, o.phase, o.step, o.layer, o.batch, o.nbytes) for o in ops])) \
            if ops else [[]] * 7
        df = pd.DataFrame({
            "op_id": np.arange(len(ops)), "kind": cols[0], "stream": cols[1], "phase": cols[2],
            "step": np.asarray(cols[3], dtype=np.int64), "layer": np.asarray(cols[4], dtype=np.int64),
            "batch": np.asarray(cols[5], dtype=np.int64), "start_s": start, "end_s": end,
            "nbytes": np.asarray(cols[6], dtype=np.int64)})
        if getattr(plan, "stages", None):  # several GPUs: each op's device
            df["device"] = np.asarray([o.device for o in ops], dtype=np.int64)
        return cls(df=df, meta=meta, peak_bytes=peak_bytes)


def _jsonable(x):
    return json.loads(json.dumps(x, default=str))

