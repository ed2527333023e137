"""Gate baselines and the ratchet (DESIGN §5): "not worse than the baseline by more than the slack".

A baseline is either another run directory (its losses are computed with the same policy) or a baseline
JSON written by `dsv4-drift gate RUN --update-baseline FILE`:

    {
      "format": "dsv4-drift-baseline/1",
      "created": "2025-01-01T00:00:00+00:00", "updated": "…",
      "values": [                       one entry per evaluated unit, sorted; one line each for reviewable diffs
        {"check": "stream-drift", "variant": "all", "mode": "global", "tap": "layer.out", "layer": 3,
         "phase": "prefill", "value": 0.0123},
        {"check": "attn-out-by-chunk", "variant": "all", "mode": "global", "tap": "attn.out", "layer": 3,
         "phase": "prefill", "scope": "chunk", "group": 1, "value": 0.0201},
        …],                             scope and group only for units of a group scope (absent: the whole layer)
      "history": [                      every update: who, when, from which run, what changed
        {"when": "…", "who": "alice", "run": "reports/x", "scenario": "flash-27k", "action": "tighten",
         "added": 0, "tightened": 12, "loosened": [], "refused": 0}, …]
    }

The ratchet: an existing value only tightens (new = min(old, observed)); new units are added; units not
observed are kept. A value that would grow is kept as it was and reported, unless `allow_loosen`, which
takes the observed values and records each loosened entry (old → new) with who and when. When nothing
changes the file is not rewritten.
"""

from __future__ import annotations

import getpass
import json
import math
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from harness.errors import UsageError
from harness.gate.evaluate import PHASE_ORDER, REL_TOL, Baseline, GateResult, evaluate, load_run, observed_values
from harness.gate.policy import Policy

BASELINE_FORMAT = "dsv4-drift-baseline/1"
ENTRY_KEYS = ("check", "variant", "mode", "tap", "layer", "phase")
GROUP_KEYS = ("scope", "group")
"""Written for units of a group scope only, so a baseline of layer-scope checks reads as before (and an older
baseline, which has no group keys, reads as layer scope)."""


def load_baseline(source: str | Path, policy: Policy) -> Baseline:
    """A baseline JSON, or a run directory evaluated with `policy`; UsageError (exit 2) when unreadable."""
    p = Path(source)
    if p.is_dir():
        result = evaluate(policy, load_run(p))
        return Baseline(dict(observed_values(result)), f"run {p}")
    if not p.is_file():
        raise UsageError(f"--baseline: {p} is neither a run directory nor a baseline JSON file")
    return Baseline(read_baseline_values(p), str(p))


def read_baseline_file(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: cannot read the baseline JSON: {e}") from None
    if not isinstance(data, dict) or data.get("format") != BASELINE_FORMAT:
        raise UsageError(f"{path}: not a dsv4-drift baseline (expected \"format\": \"{BASELINE_FORMAT}\")")
    if not isinstance(data.get("values"), list):
        raise UsageError(f"{path}: \"values\" must be a list of entries")
    return data


def read_baseline_values(path: Path) -> dict[tuple, float]:
    data = read_baseline_file(path)
    values = {}
    for i, entry in enumerate(data["values"]):
        try:
            key = _key(entry)
            value = float(entry["value"])
        except (KeyError, TypeError, ValueError) as e:
            raise UsageError(f"{path}: values[{i}]: needs {', '.join(ENTRY_KEYS)} and a numeric value, and an integer "
                             f"{GROUP_KEYS[1]} where a {GROUP_KEYS[0]} other than layer is given ({e})") from None
        if not math.isfinite(value) or value < 0:
            raise UsageError(f"{path}: values[{i}]: value {entry['value']!r} must be a finite number ≥ 0")
        values[key] = value
    return values


def _key(entry: dict[str, Any]) -> tuple:
    group = entry.get("group")
    return (str(entry["check"]), str(entry["variant"]), str(entry["mode"]), str(entry["tap"]), int(entry["layer"]),
            str(entry["phase"]), str(entry.get("scope", "layer")), None if group is None else int(group))


def _entry(key: tuple, value: float) -> dict[str, Any]:
    entry = dict(zip(ENTRY_KEYS, key))
    scope, group = key[len(ENTRY_KEYS):]
    if scope != "layer":
        entry |= dict(zip(GROUP_KEYS, (scope, group)))
    return entry | {"value": value}


@dataclass
class RatchetReport:
    path: Path
    written: bool
    created: bool
    added: int = 0
    tightened: int = 0
    loosened: list[dict[str, Any]] = field(default_factory=list)  # applied (allow_loosen)
    refused: list[dict[str, Any]] = field(default_factory=list)  # would have loosened; kept

    def summary(self) -> str:
        if self.created:
            return f"baseline {self.path}: created with {self.added} values"
        text = (f"baseline {self.path}: " + ("updated" if self.written else "unchanged")
                + f" ({self.added} added, {self.tightened} tightened, {len(self.loosened)} loosened)")
        if self.refused:
            e = self.refused[0]
            group = f" {e['scope']} {e['group']}" if "scope" in e else ""
            text += (f"; refused to loosen {len(self.refused)} value(s), e.g. {e['check']} [{e['variant']}] layer "
                     f"{e['layer']} {e['phase']}{group} ({e['mode']}, {e['tap']}): {e['old']:.4g} → {e['new']:.4g}, "
                     f"kept {e['old']:.4g}; pass --allow-loosen to accept (it is recorded in the file)")
        return text


def who() -> str:
    """Who is updating: the CI actor when there is one, else the local user."""
    actor = os.environ.get("GITHUB_ACTOR") or os.environ.get("GITLAB_USER_LOGIN") or os.environ.get("USER")
    if actor:
        return actor
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no user database in some containers
        return "unknown"


def update_baseline(path: str | Path, result: GateResult, allow_loosen: bool = False,
                    user: str | None = None) -> RatchetReport:
    """Write the run's observed losses to the baseline file, tightening only unless allow_loosen (recorded)."""
    path = Path(path)
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    observed = dict(observed_values(result))
    event = {"when": now, "who": user or who(), "run": str(result.run.dir), "scenario": result.run.scenario,
             "policy": result.policy.file}
    if not path.exists():
        data = {"format": BASELINE_FORMAT, "created": now, "updated": now,
                "values": [_entry(k, v) for k, v in observed.items()],
                "history": [event | {"action": "create", "added": len(observed)}]}
        _write(path, data)
        return RatchetReport(path, True, True, added=len(observed))
    data = read_baseline_file(path)
    old = read_baseline_values(path)
    new = dict(old)
    report = RatchetReport(path, False, False)
    for key, value in observed.items():
        if key not in old:
            new[key] = value
            report.added += 1
        elif value > old[key] + REL_TOL * old[key]:
            change = _entry(key, value) | {"old": old[key], "new": value}
            del change["value"]
            if allow_loosen:
                new[key] = value
                report.loosened.append(change)
            else:
                report.refused.append(change)
        elif value < old[key]:
            new[key] = value
            report.tightened += 1
    if not (report.added or report.tightened or report.loosened):
        return report  # nothing to write: the file stays byte-identical
    action = "loosen" if report.loosened else "tighten" if report.tightened else "add"
    history = list(data.get("history") or [])
    history.append(event | {"action": action, "added": report.added, "tightened": report.tightened,
                            "loosened": report.loosened, "refused": len(report.refused)})
    data.update(updated=now, values=[_entry(k, v) for k, v in new.items()], history=history)
    _write(path, data)
    report.written = True
    return report


def _sort_key(entry: dict[str, Any]) -> tuple:
    group = entry.get("group")
    return (entry["check"], entry["variant"], entry["mode"], entry["tap"], PHASE_ORDER.get(entry["phase"], 9),
            entry["layer"], -math.inf if group is None else group)


def _write(path: Path, data: dict[str, Any]) -> None:
    """Pretty JSON with one line per value entry (reviewable diffs), written atomically."""
    values = sorted(data["values"], key=_sort_key)
    parts = []
    for key, value in data.items():
        if key == "values":
            body = "[\n" + ",\n".join("    " + json.dumps(e) for e in values) + "\n  ]" if values else "[]"
        else:
            body = json.dumps(value, indent=2).replace("\n", "\n  ")
        parts.append(f"  {json.dumps(key)}: {body}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("{\n" + ",\n".join(parts) + "\n}\n")
    os.replace(tmp, path)
