"""An incident: what the driver's watcher saw, whom it blames, what it did. Written as JSON and
markdown under ``<run_dir>/incidents/`` and listed in the run record (``run.json: incidents``)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

INCIDENTS_DIR = "incidents"


@dataclass
class Incident:
    kind: str  # "hang" | "straggler" | "store" (the watcher); "rank-exit" | "nan" | "spike" | "eviction" (mega.launch.incidents)
    attempt: int
    detected_at: float  # unix time
    summary: str  # one line for people
    culprit: dict | None = (
        None  # localise.Culprit.to_dict(): rank, node, coords, ...; {"store": url} for "store"
    )
    evidence: dict = field(default_factory=dict)  # the numbers the verdict rests on
    action: str = "none"  # "relaunch from latest" | "reported" ...
    steps_lost: int | None = None  # steps done since the checkpoint the relaunch resumes from
    time_to_detect_s: float | None = None  # from the last progress to the verdict
    # what was found about the cause: the culprit node's self-check verdict, error lines of its log
    diagnosis: str | None = None
    # from detected_at to the first step the next attempt logged; None: not (yet) recovered
    time_to_recover_s: float | None = None

    def name(self, index: int) -> str:
        return f"{index:03d}-attempt{self.attempt}-{self.kind}"

    def markdown(self) -> str:
        c = self.culprit or {}
        coords = c.get("coords") or {}
        rows = [
            ("detected at", time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.detected_at))),
            ("kind", self.kind),
            ("attempt", self.attempt),
            ("culprit", _who(c)),
            ("coordinates", ", ".join(f"{k} {v}" for k, v in coords.items()) if coords else "-"),
            (
                "group held up",
                f"{c.get('group')} {c.get('group_ranks')}, {c.get('behind')} behind"
                if c.get("group")
                else "-",
            ),
            ("why", c.get("reason", "-")),
            ("diagnosis", _cell(self.diagnosis or "-")),
            ("action", self.action),
            ("steps lost", "-" if self.steps_lost is None else self.steps_lost),
            ("time to detect", "-" if self.time_to_detect_s is None else f"{self.time_to_detect_s:.1f} s"),
            (
                "time to recovery",
                "not recovered" if self.time_to_recover_s is None else f"{self.time_to_recover_s:.1f} s",
            ),
        ]
        table = "\n".join(f"| {k} | {v} |" for k, v in rows)
        return (
            f"# Incident: {self.kind}\n\n{self.summary}\n\n| | |\n|---|---|\n{table}\n\n"
            f"## Evidence\n\n```json\n{json.dumps(self.evidence, indent=2, default=str)}\n```\n"
        )

    def write(self, run_dir: str | Path) -> Path:
        """``incidents/<nnn>-attempt<a>-<kind>.json`` and ``.md``; returns the JSON's path."""
        d = Path(run_dir) / INCIDENTS_DIR
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"{self.name(len(list(d.glob('*.json'))))}.json"
        return self.rewrite(path)

    def rewrite(self, path: Path) -> Path:
        """(Re)write the incident at ``path`` (.json and .md): once written, then when the driver
        learns more (the diagnosis, the time to recovery)."""
        path.write_text(json.dumps(asdict(self), indent=2, default=str))
        path.with_suffix(".md").write_text(self.markdown())
        return path

    @classmethod
    def read(cls, path: Path) -> Incident:
        row = json.loads(Path(path).read_text())
        return cls(**{k: v for k, v in row.items() if k in cls.__dataclass_fields__})

    def brief(self, path: Path) -> dict:
        """What the run record keeps of it."""
        c = self.culprit or {}
        return {
            "kind": self.kind,
            "attempt": self.attempt,
            "detected_at": self.detected_at,
            "culprit_rank": c.get("rank"),
            "culprit_node": c.get("node"),
            "coords": c.get("coords"),
            "group": c.get("group"),
            "action": self.action,
            "steps_lost": self.steps_lost,
            "diagnosis": self.diagnosis,
            "time_to_recover_s": self.time_to_recover_s,
            "file": str(path.relative_to(path.parent.parent)),
        }


def _who(c: dict) -> str:
    if not c:
        return "not named"
    if "store" in c:
        return f"heartbeat Redis {c['store']}"
    if c.get("rank") is None:
        return f"node {c.get('node')} ({c.get('host')})"
    ranks = c.get("ranks") or [c["rank"]]
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} on node {c.get('node')} ({c.get('host')})"


def _cell(text: str) -> str:
    """Text in a markdown table cell: one line, no column breaks."""
    return text.replace("|", "\\|").replace("\n", "<br>")


def read_incidents(run_dir: str | Path) -> list[dict]:
    """Every incident of a run, oldest first."""
    d = Path(run_dir) / INCIDENTS_DIR
    return [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))] if d.exists() else []
